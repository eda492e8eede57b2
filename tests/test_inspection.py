"""The exact weights of a call and their statistics (docs/contract.md §2.9).

Checked against the reference backend's materialised weights and against
the calls' outputs (``weights @ v`` is the output), row subsets against all
rows, statistics against the same statistics of the materialised weights,
over block boundaries, and the memory of a few rows of a long problem.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import attnnb
from attnnb import inspection, patterns
from attnnb._front.validate import attention_problem
from attnnb.reference.attention import attention_weights


def _qkv(rng, B=2, Hq=4, Hk=2, Lq=70, Lk=75, D=8, Dv=5):
    return (rng.standard_normal((B, Hq, Lq, D)), rng.standard_normal((B, Hk, Lk, D)),
            rng.standard_normal((B, Hk, Lk, Dv)))


def _values(v, heads):
    return np.repeat(v, heads // v.shape[1], axis=1)


ATTENTION_CASES = {
    "causal, Lq < Lk": dict(causal=True),
    "mask, bias, key sizes": dict(mask="mask", bias="bias", key_size="sizes"),
    "softmax1": dict(normalizer="softmax1", causal=True),
    "relu_expm1": dict(normalizer="relu_expm1", bias="bias"),
    "sinks": dict(sinks="sinks", causal=True),
    "dropout": dict(dropout_p=0.3, seed=11, causal=True, key_size="sizes"),
}


def _arguments(rng, spec, B=2, Hq=4, Lq=70, Lk=75):
    made = {"mask": rng.random((B, 1, Lq, Lk)) < 0.7, "bias": rng.standard_normal((Lq, Lk)),
            "sizes": rng.uniform(0.5, 3.0, (B, Lk)), "sinks": rng.standard_normal(Hq)}
    return {n: made.get(x, x) if isinstance(x, str) and n != "normalizer" else x
            for n, x in spec.items()}


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_weights_are_the_references(case):
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng)
    kw = _arguments(rng, ATTENTION_CASES[case])
    w = attnnb.weights(attnnb.attention, q, k, v, **kw)
    problem = attention_problem(q, k, v, **kw)
    ref, _, _ = attention_weights(problem)
    if problem.dropout_p:
        from attnnb.reference.attention import dropout_factors

        ref = ref * dropout_factors(problem)
    np.testing.assert_array_equal(w, ref)
    out = attnnb.attention(q, k, v, backend="cpu", **kw)
    np.testing.assert_allclose(w @ _values(v, 4), out, rtol=1e-12, atol=1e-13)


def test_rows_are_the_same_rows_of_all_rows():
    """To rounding: BLAS may block a product of fewer rows differently (an ulp)."""
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng)
    kw = dict(causal=True, bias=rng.standard_normal((70, 75)), dropout_p=0.2, seed=3)
    whole = attnnb.weights(attnnb.attention, q, k, v, **kw)
    for rows, idx in ((slice(5, 60, 7), np.arange(5, 60, 7)), ([-1, 0, 33], [69, 0, 33]),
                      (4, [4]), (np.array([], int), [])):
        np.testing.assert_allclose(
            attnnb.weights(attnnb.attention, q, k, v, rows=rows, **kw), whole[:, :, idx],
            rtol=1e-14, atol=1e-17)


def test_sparse_and_topk_weights_give_their_outputs():
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, Lq=75)
    per_head = patterns.local(75, 6) | patterns.fixed(75, 16, 2)
    per_head = patterns.from_mask(np.stack([per_head.to_mask(), patterns.local(75, 2).to_mask(),
                                            per_head.to_mask(), np.eye(75, dtype=bool)]))
    for pattern in (patterns.local(75, 9, causal=True), per_head):
        w = attnnb.weights(attnnb.sparse_attention, q, k, v, pattern, dropout_p=0.4, seed=1)
        out = attnnb.sparse_attention(q, k, v, pattern, dropout_p=0.4, seed=1, backend="cpu")
        np.testing.assert_allclose(w @ _values(v, 4), out, rtol=1e-12, atol=1e-13)
        assert not w[..., ~np.broadcast_to(pattern.to_mask(), w.shape[1:])].any()
    w = attnnb.weights(attnnb.topk_attention, q, k, v, 6, causal=True, rows=slice(10, None))
    out = attnnb.topk_attention(q, k, v, 6, causal=True, backend="cpu")
    np.testing.assert_allclose(w @ _values(v, 4), out[:, :, 10:], rtol=1e-12, atol=1e-13)
    assert ((w > 0).sum(-1) == 6).all()


@pytest.mark.parametrize("mode", ["difference", "rectified"])
def test_diff_weights_and_maps(mode):
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 4, 30, 8))
    k = rng.standard_normal((2, 2, 33, 8))
    v = rng.standard_normal((2, 1, 33, 6))
    lam = rng.uniform(0.3, 0.9, (2, 1))
    kw = dict(mode=mode, causal=True, dropout_p=0.25, seed=9)
    w, a1, a2 = attnnb.weights(attnnb.diff_attention, q, k, v, lam, maps=True, **kw)
    out = attnnb.diff_attention(q, k, v, lam, backend="cpu", **kw)
    np.testing.assert_allclose(w @ _values(v, 2), out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(a1.sum(-1), 1.0, rtol=1e-13)  # the maps are softmaxes
    combined = a1 - lam[..., None] * a2
    if mode == "rectified":
        combined = np.maximum(combined, 0.0)
    dropped = w == 0
    np.testing.assert_allclose(w[~dropped], combined[~dropped] / 0.75, rtol=1e-13)
    if mode == "difference":
        assert (w < 0).any()


def test_float32_calls_give_float32_weights_of_the_float32_logits():
    rng = np.random.default_rng(5)
    q, k, v = (x.astype(np.float32) for x in _qkv(rng))
    w = attnnb.weights(attnnb.attention, q, k, v, causal=True)
    assert w.dtype == np.float32
    np.testing.assert_allclose(w @ _values(v, 4), attnnb.attention(q, k, v, causal=True),
                               rtol=1e-5, atol=1e-6)


def test_two_dimensional_input_and_empty_rows():
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((9, 4)), rng.standard_normal((12, 4)),
               rng.standard_normal((12, 3)))
    mask = np.ones((9, 12), bool)
    mask[3] = False
    w = attnnb.weights(attnnb.attention, q, k, v, mask=mask, bias=1e4 * (mask - 1.0) + 0.5)
    assert w.shape == (9, 12)
    assert not w[3].any()
    s = attnnb.attention_stats(attnnb.attention, q, k, v, mask=mask,
                               stats=("argmax", "max", "zeros", "entropy"))
    assert s["argmax"][3] == -1 and s["max"][3] == 0 and s["zeros"][3] == 0
    assert s["entropy"][3] == 0


def _stats_of(w, allowed, key_mask):
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.sum(np.where(w > 0, w * np.log(np.where(w > 0, w, 1)), 0), axis=-1)
    argmax = np.where(allowed.any(-1), np.argmax(w, -1), -1)
    return {"entropy": entropy, "max": w.max(-1), "argmax": argmax,
            "mass": w[..., key_mask].sum(-1), "zeros": (allowed & (w == 0)).sum(-1),
            "negative_mass": np.minimum(w, 0).sum(-1), "received": w.sum(-2)}


@pytest.mark.parametrize("fn", ["attention", "relu_expm1", "diff_attention", "topk"])
def test_stats_equal_those_of_the_materialised_weights(fn, monkeypatch):
    """Over blocks of 7 rows (the block boundaries fall inside the problem)."""
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, Lq=40, Lk=45)
    mask = rng.random((40, 45)) < 0.8
    mask[5] = False
    if fn == "diff_attention":
        call = (attnnb.diff_attention, q, k, v[:, :1], 0.8)
        kw = dict(mask=mask, mode="rectified")
    elif fn == "topk":
        call = (attnnb.topk_attention, q, k, v, 4)
        kw = dict(mask=mask)
    else:
        call = (attnnb.attention, q, k, v)
        kw = dict(mask=mask, normalizer="relu_expm1" if fn == "relu_expm1" else "softmax",
                  dropout_p=0.3, seed=2)
    w = attnnb.weights(*call, **kw)
    allowed = np.broadcast_to(mask, w.shape)
    if fn == "topk":
        allowed = w > 0
    key_mask = np.zeros(45, bool)
    key_mask[[0, 44]] = True
    expected = _stats_of(w, allowed, key_mask)
    monkeypatch.setattr(inspection, "_BLOCK_ELEMENTS", 2 * w.shape[1] * 45 * 7)
    got = attnnb.attention_stats(*call, stats=inspection.STATS, keys=[0, -1], **kw)
    assert list(got) == list(inspection.STATS)
    for name in inspection.STATS:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-12, atol=1e-13,
                                   err_msg=name)
    if fn in ("relu_expm1", "diff_attention"):
        assert got["zeros"].sum() > 0  # relu_expm1 and the clip put zeros
    if fn == "diff_attention":
        assert got["negative_mass"].min() == 0.0  # rectified: none negative


def test_a_few_rows_of_a_long_problem_take_a_few_rows_of_memory():
    rng = np.random.default_rng(8)
    n = 8192
    q = rng.standard_normal((1, 1, n, 8)).astype(np.float32)
    k = rng.standard_normal((1, 1, n, 8)).astype(np.float32)
    tracemalloc.start()
    try:
        w = attnnb.weights(attnnb.attention, q, k, k, causal=True, rows=[0, n // 2, n - 1])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert w.shape == (1, 1, 3, n)
    assert peak < 64 * 3 * n * 8  # a few (3, n) float64 arrays, not (n, n): 512 MB
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)


def test_refusals_name_the_argument():
    rng = np.random.default_rng(9)
    q, k, v = _qkv(rng, Lq=6, Lk=6)
    with pytest.raises(TypeError, match="weights supports attnnb.attention"):
        attnnb.weights(np.dot, q, k)
    with pytest.raises(TypeError, match="rows must be"):
        attnnb.weights(attnnb.attention, q, k, v, rows=np.ones(6, bool))
    with pytest.raises(IndexError, match="rows holds 6"):
        attnnb.weights(attnnb.attention, q, k, v, rows=[6])
    with pytest.raises(ValueError, match="maps=True is for attnnb.diff_attention"):
        attnnb.weights(attnnb.attention, q, k, v, maps=True)
    with pytest.raises(TypeError, match="needs keys="):
        attnnb.attention_stats(attnnb.attention, q, k, v, stats="mass")
    with pytest.raises(ValueError, match="stats must name"):
        attnnb.attention_stats(attnnb.attention, q, k, v, stats=("entropy", "mean"))
    with pytest.raises(ValueError, match="keys= is read by"):
        attnnb.attention_stats(attnnb.attention, q, k, v, keys=[0])
    with pytest.raises(TypeError, match="causal must be True or False"):
        attnnb.weights(attnnb.attention, q, k, v, causal=1)
    with pytest.raises(TypeError, match="unexpected keyword"):
        attnnb.weights(attnnb.attention, q, k, v, window=3)


# ---------------------------------------------------------------------------
# the seeds' three facts, on the weights themselves


def test_a_merged_key_weighs_what_its_duplicates_weigh_together():
    """2 exp(q.k1) / (2 exp(q.k1) + exp(q.k3)): key size 2 against the key twice."""
    rng = np.random.default_rng(10)
    q, k, v = (rng.standard_normal((1, 1, 5, 4)) for _ in range(3))
    merged = attnnb.weights(attnnb.attention, q, k, v, key_size=np.array([2, 1, 1, 1, 1]))
    dup = attnnb.weights(attnnb.attention, q, np.concatenate([k[:, :, :1], k], 2),
                         np.concatenate([v[:, :, :1], v], 2))
    np.testing.assert_allclose(merged[..., 0], dup[..., 0] + dup[..., 1], rtol=1e-14)
    np.testing.assert_allclose(merged[..., 1:], dup[..., 2:], rtol=1e-14)


def test_sparse_weights_rise_by_the_mass_they_lost():
    """Kept weights are the dense ones divided by the dense mass of the kept set."""
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 1, 16, 4)) for _ in range(3))
    pattern = patterns.local(16, 2)
    dense = attnnb.weights(attnnb.attention, q, k, v)
    sparse = attnnb.weights(attnnb.sparse_attention, q, k, v, pattern)
    keep = pattern.to_mask()
    kept_mass = np.where(keep, dense, 0).sum(-1, keepdims=True)
    np.testing.assert_allclose(sparse, np.where(keep, dense / kept_mass, 0), rtol=1e-13)


STATS_CASES = {
    "causal, Lq < Lk, GQA": dict(causal=True),
    "mask, bias, key sizes": dict(mask="mask", bias="bias", key_size="sizes"),
    "relu_expm1, causal": dict(normalizer="relu_expm1", causal=True, bias="bias"),
    "sinks": dict(sinks="sinks"),
    "softmax1, dropout": dict(normalizer="softmax1", dropout_p=0.4, seed=21, mask="mask"),
}


@pytest.mark.parametrize("case", STATS_CASES)
@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 2e-5)])
def test_cpu_stats_pass_equals_the_reference_rows(case, dtype, rtol):
    """The compiled pass (attnnb.cpu.stats; several tasks per head) against the float64
    rows, with a NaN row and an empty row among them."""
    rng = np.random.default_rng(12)
    q, k, v = (x.astype(dtype) for x in _qkv(rng, B=2, Hq=4, Hk=2, Lq=150, Lk=160))
    q[1, 2, 7, 0] = np.nan
    kw = _arguments(rng, STATS_CASES[case], Lq=150, Lk=160)
    if "mask" in kw:
        kw["mask"][0, 0, 3] = False
    got = attnnb.attention_stats(attnnb.attention, q, k, v, stats=inspection.STATS,
                                 keys=[0, 159], backend="cpu", **kw)
    ref = attnnb.attention_stats(attnnb.attention, q, k, v, stats=inspection.STATS,
                                 keys=[0, 159], backend="reference", **kw)
    for name in inspection.STATS:
        if name in ("argmax", "zeros") and dtype == np.float32:
            continue  # float32 logits round ties and underflows their own way
        np.testing.assert_allclose(got[name], ref[name], rtol=rtol, atol=rtol,
                                   err_msg=name)
    assert np.isnan(got["entropy"][1, 2, 7]) and got["argmax"][1, 2, 7] == -1
    assert np.isnan(got["received"][1, 2]).all()
    if "mask" in kw:
        assert got["argmax"][0, 0, 3] == -1 and got["max"][0, 0, 3] == 0


def test_readme_inspection_block_runs():
    import pathlib
    import re

    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    match = re.search(r"<!-- usage:inspection -->\n```python\n(.*?)```\n"
                      r"<!-- /usage:inspection -->", text, re.S)
    assert match, "README has no usage:inspection block"
    namespace: dict = {}
    exec(compile(match.group(1), "README.md:usage:inspection", "exec"), namespace)
    assert namespace["w"].shape == (1, 8, 2, 4096)
    assert namespace["s"]["received"].shape == (1, 8, 4096)


@pytest.mark.parametrize("normalizer", ["sigmoid", "softpick"])
def test_weights_of_the_unnormalised_and_the_rectified(normalizer):
    """Sigmoid's and softpick's weights (the host rows: not the compiled pass)."""
    rng = np.random.default_rng(13)
    q, k, v = _qkv(rng, Lq=20, Lk=25)
    kw = dict(normalizer=normalizer, causal=True, bias=2.0 * rng.standard_normal((20, 25)))
    w = attnnb.weights(attnnb.attention, q, k, v, **kw)
    out = attnnb.attention(q, k, v, backend="cpu", **kw)
    np.testing.assert_allclose(w @ _values(v, 4), out, rtol=1e-12, atol=1e-13)
    s = attnnb.attention_stats(attnnb.attention, q, k, v, stats=("max", "zeros"), **kw)
    np.testing.assert_allclose(s["max"], np.maximum(w.max(-1), 0.0), rtol=1e-13)
    allowed = np.tril(np.ones((20, 25), bool), 5)
    assert (s["zeros"] == (allowed & (w == 0)).sum(-1)).all()
    assert (s["zeros"] > 0).any() == (normalizer == "softpick")


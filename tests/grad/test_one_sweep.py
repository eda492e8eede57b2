"""The one-sweep backward (attnnb/cpu/backward.py, ``dkdv_kernel`` owning ``dq``) against two.

From ``B * Hk >= ONE_SWEEP_TASKS`` the cpu backward forms ``dq``, ``dk`` and
``dv`` in one sweep per (batch, key head); below, a ``dk``/``dv`` sweep per
key tile and a ``dq`` sweep per query tile.  Both recompute every pair's
weights with the same shared code and add ``dq``'s terms in key-tile order,
so the two paths must give the same bits for every option; the two-sweep
path is tested against the reference in test_cpu.py, and the one-sweep
path against it again here.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnnb
import attnnb.cpu.backward as backward
from attnnb import patterns

SHAPES = dict(B=2, Hq=8, Hk=4, Lq=70, Lk=131, D=24, Dv=40)  # B * Hk = 8 key heads


def _inputs(dtype, seed=5):
    rng = np.random.default_rng(seed)
    s = SHAPES
    q = rng.standard_normal((s["B"], s["Hq"], s["Lq"], s["D"])).astype(dtype)
    k = rng.standard_normal((s["B"], s["Hk"], s["Lk"], s["D"])).astype(dtype)
    v = rng.standard_normal((s["B"], s["Hk"], s["Lk"], s["Dv"])).astype(dtype)
    return q, k, v, rng


def _options(name, dtype, rng):
    s = SHAPES
    local = patterns.local((s["Lq"], s["Lk"]), 13) | patterns.longformer((s["Lq"], s["Lk"]),
                                                                         0, [5])
    if name == "mask+bias+key_size+causal+dlse":
        return attnnb.attention, (), dict(
            mask=rng.random((s["Lq"], s["Lk"])) > 0.2,
            bias=rng.standard_normal((s["Hq"], 1, s["Lk"])).astype(dtype),
            key_size=rng.integers(1, 4, (s["B"], s["Lk"])).astype(dtype), causal=True,
            return_lse=True)
    if name in ("softmax1", "relu_expm1"):
        return attnnb.attention, (), dict(normalizer=name, causal=name == "relu_expm1")
    if name == "sparse":
        return attnnb.sparse_attention, (local,), {}
    if name == "topk":
        return attnnb.topk_attention, (9,), dict(causal=True)
    raise AssertionError(name)


def _gradients(fn, args, kwargs, threshold, backend="cpu", seed=6):
    old = backward.ONE_SWEEP_TASKS
    backward.ONE_SWEEP_TASKS = threshold
    try:
        result, pullback = attnnb.vjp(fn, *args, backend=backend, **kwargs)
        rng = np.random.default_rng(seed)
        if kwargs.get("return_lse"):
            out, lse = result
            return pullback(rng.standard_normal(out.shape).astype(out.dtype),
                            rng.standard_normal(lse.shape).astype(lse.dtype))
        return pullback(rng.standard_normal(result.shape).astype(result.dtype))
    finally:
        backward.ONE_SWEEP_TASKS = old


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["mask+bias+key_size+causal+dlse", "softmax1", "relu_expm1",
                                  "sparse", "topk"])
def test_one_sweep_gives_the_two_sweeps_bits(dtype, name):
    q, k, v, rng = _inputs(dtype)
    fn, extra, kwargs = _options(name, dtype, rng)
    one = _gradients(fn, (q, k, v, *extra), kwargs, threshold=1)
    two = _gradients(fn, (q, k, v, *extra), kwargs, threshold=10**9)
    assert one.keys() == two.keys()
    for key in one:
        if one[key] is None:
            assert two[key] is None, key
            continue
        np.testing.assert_array_equal(one[key], two[key], err_msg=key)
    f64 = tuple(x.astype(np.float64) for x in (q, k, v))
    want = _gradients(fn, (*f64, *extra),
                      {key: (val.astype(np.float64) if isinstance(val, np.ndarray)
                             and val.dtype == dtype else val) for key, val in kwargs.items()},
                      threshold=1, backend="reference")
    tol = 1e-12 if dtype == np.float64 else 1e-4
    for key, w in want.items():
        if w is None:
            continue
        err = np.abs(one[key] - w).max() / max(np.abs(w).max(), 1e-300)
        assert err <= tol, (key, err)


def test_the_shape_alone_chooses_the_sweep(monkeypatch):
    """Eight key heads take one sweep, four take two, whatever the thread count."""
    monkeypatch.setattr(backward, "ONE_SWEEP_TASKS", 8)
    q, k, v, _ = _inputs(np.float32)
    seen = []
    real_launch = backward.launch

    def launch(fn, *args):
        # the dk/dv kernel's own_dq: its 16th argument, after need_dbias
        seen.append((fn.py_func.__name__, args[15] if fn is backward.dkdv_kernel else None))
        return real_launch(fn, *args)

    monkeypatch.setattr(backward, "launch", launch)
    dout = np.ones(q.shape[:3] + (v.shape[3],), np.float32)
    attnnb.vjp(attnnb.attention, q, k, v, backend="cpu")[1](dout)
    assert seen == [("dkdv_kernel", True)]
    seen.clear()
    attnnb.vjp(attnnb.attention, q[:1], k[:1], v[:1], backend="cpu")[1](dout[:1])
    assert seen == [("dkdv_kernel", False), ("dq_kernel", None)]


def test_non_finite_keys_and_values_as_the_two_sweeps(monkeypatch):
    """A key tile holding Inf behind a mask: ``dq`` skips its zero weights in both paths."""
    q, k, v, rng = _inputs(np.float32)
    k, v = k.copy(), v.copy()
    k[:, :, 77] = np.inf
    v[:, :, 77] = np.nan
    mask = np.ones((SHAPES["Lq"], SHAPES["Lk"]), bool)
    mask[:, 77] = False
    one = _gradients(attnnb.attention, (q, k, v), dict(mask=mask), threshold=1)
    two = _gradients(attnnb.attention, (q, k, v), dict(mask=mask), threshold=10**9)
    assert np.isfinite(one["q"]).all()
    for key in ("q", "k", "v"):
        np.testing.assert_array_equal(one[key], two[key], err_msg=key)


@pytest.mark.parametrize("threshold", [1, 10**9], ids=["one sweep", "two sweeps"])
@pytest.mark.parametrize("name", ["mask+bias+key_size+causal+dlse", "sparse", "topk",
                                  "unseen key tiles"])
def test_every_gradient_element_is_written(monkeypatch, threshold, name):
    """``dq`` (two sweeps), ``dk`` and ``dv`` start unset (``backward.written_whole``):
    started as NaN instead, every element still comes out as with the plain buffers,
    the keys that no query sees included (zeros)."""
    dtype = np.float32
    q, k, v, rng = _inputs(dtype)
    if name == "unseen key tiles":  # keys 60 on are outside every row's set
        allowed = np.zeros((SHAPES["Lq"], SHAPES["Lk"]), bool)
        allowed[:, :60] = rng.random((SHAPES["Lq"], 60)) > 0.5
        fn, extra, kwargs = attnnb.sparse_attention, (patterns.from_mask(allowed),), {}
    else:
        fn, extra, kwargs = _options(name, dtype, rng)
    plain = _gradients(fn, (q, k, v, *extra), kwargs, threshold)
    monkeypatch.setattr(backward, "written_whole", lambda shape, dt: np.full(shape, np.nan, dt))
    poisoned = _gradients(fn, (q, k, v, *extra), kwargs, threshold)
    for key in ("q", "k", "v"):
        assert np.isfinite(poisoned[key]).all(), key
        np.testing.assert_array_equal(poisoned[key], plain[key], err_msg=key)
    if name == "unseen key tiles":
        np.testing.assert_array_equal(poisoned["k"][:, :, 60:], 0.0)

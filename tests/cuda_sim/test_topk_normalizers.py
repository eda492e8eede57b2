"""``topk_attention(normalizer=...)`` on the cuda backend for the normalizers that weigh
the kept keys their own way (docs/contract.md §2.3): outputs, LSEs and every gradient
against the float64 reference.  The keys are ranked as softmax ranks them; sigmoid's
bias takes no part in the ranking.  Small sizes: the simulator runs a thread per GPU
thread."""

import numpy as np
import pytest

import attnnb

from ..helpers import assert_close, qkv
from .common import n
from .test_normalizers import _compare_vjp  # (tolerances: float64 1e-12, float32 2e-5 / 1e-4)

NORMALIZERS = ["softmax1", "relu_expm1", "sigmoid", "softpick"]

CASES = {
    # top_k below the allowed count
    "GQA, key sizes": dict(hq=4, hk=2, lq=n(9), lk=n(13), top_k=4, key_size=True),
    # an empty row (Lq > Lk, causal: the first rows see no key); top_k above the allowed
    # count in the early rows
    "causal, empty rows": dict(hq=2, hk=1, lq=n(11), lk=n(8), top_k=3, causal=True),
    "mask with an empty row, key sizes": dict(hq=2, hk=2, lq=n(7), lk=n(10), top_k=5,
                                              mask=True, key_size=True),
    "top_k above every row's count": dict(hq=2, hk=1, lq=n(6), lk=n(9), top_k=20,
                                          key_size=True),
    # integer logits: many ties, decided by the lower key index
    "ties": dict(hq=2, hk=2, lq=n(8), lk=n(12), top_k=3, ties=True),
    "ties, key sizes, causal": dict(hq=2, hk=1, lq=n(8), lk=n(12), top_k=4, ties=True,
                                    key_size=True, causal=True),
    "dropout, key sizes": dict(hq=2, hk=1, lq=n(7), lk=n(10), top_k=4, key_size=True,
                               dropout=True),
}


def _arguments(rng, case, dtype):
    spec = dict(CASES[case])
    hq, hk, lq, lk, top_k = (spec.pop(x) for x in ("hq", "hk", "lq", "lk", "top_k"))
    q, k, v = qkv(rng, batch=(2,), hq=hq, hk=hk, lq=lq, lk=lk, d=4, dv=5, dtype=dtype,
                  scale=1.5)
    if spec.pop("ties", False):  # integer q and k: equal logits within a row
        q = rng.integers(-1, 2, q.shape).astype(dtype)
        k = rng.integers(-1, 2, k.shape).astype(dtype)
    kw = dict(causal=spec.pop("causal", False), return_lse=True)
    if spec.pop("key_size", False):
        # (integer sizes keep the tied logits tied: log 2 added to equal values)
        kw["key_size"] = rng.integers(1, 3, (2, lk)).astype(dtype)
    if spec.pop("dropout", False):
        kw.update(dropout_p=0.25, seed=7)
    if spec.pop("mask", False):
        mask = rng.random((2, 1, lq, lk)) > 0.3
        mask[:, :, 1] = False  # an empty row
        kw["mask"] = mask
    assert not spec
    return q, k, v, top_k, kw


def _check(rng, case, normalizer, dtype, **extra):
    q, k, v, top_k, kw = _arguments(rng, case, dtype)
    kw.update(normalizer=normalizer, **extra)
    return _compare_vjp(attnnb.topk_attention, (q, k, v, top_k), kw, dtype, rng)[0]


# each case with two normalizers, each normalizer in three or four cases (the simulator
# runs a Python thread per GPU thread: the whole product would double the file's time)
PAIRS = [(case, NORMALIZERS[(at + shift) % len(NORMALIZERS)])
         for at, case in enumerate(CASES) for shift in (0, 1)]


@pytest.mark.parametrize("case, normalizer", PAIRS)
def test_float64(rng, case, normalizer):
    _check(rng, case, normalizer, np.float64)


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("case", ["GQA, key sizes", "causal, empty rows"])
def test_float32(rng, case, normalizer):
    _check(rng, case, normalizer, np.float32)


def test_sigmoid_bias(rng):
    """A non-default ``sigmoid_bias`` weighs the kept keys and leaves the ranking alone."""
    out = _check(rng, "GQA, key sizes", "sigmoid", np.float32, sigmoid_bias=1.3)
    other = _check(rng, "GQA, key sizes", "sigmoid", np.float32, sigmoid_bias=-0.4)
    assert not np.allclose(out, other)


def test_the_kept_keys_are_softmax_ranking(rng):
    """Every normalizer keeps the keys softmax keeps: with them as the mask, attention
    gives the same output."""
    q, k, v, top_k, kw = _arguments(rng, "GQA, key sizes", np.float64)
    kw.pop("return_lse")
    for normalizer in NORMALIZERS:
        got = attnnb.topk_attention(q, k, v, top_k, normalizer=normalizer, backend="cuda",
                                    **kw)
        want = attnnb.topk_attention(q, k, v, top_k, normalizer=normalizer,
                                     backend="cpu", **kw)
        assert_close(got, want, np.float64, rtol=1e-12)


@pytest.mark.parametrize("normalizer", ["relu_expm1", "sigmoid", "softpick"])
def test_score_and_mask_functions(rng, normalizer):
    """The ranking logits after a score function (its gradients too), within a mask
    function's keys."""
    from attnnb import mods

    q, k, v, top_k, kw = _arguments(rng, "GQA, key sizes", np.float64)
    kw.update(normalizer=normalizer, score_mod=mods.softcap(np.array(2.5)),
              mask_mod=mods.sliding_window(6))
    (out, lse), pb = attnnb.vjp(attnnb.topk_attention, q, k, v, top_k, backend="cuda", **kw)
    (ref, ref_lse), pb_ref = attnnb.vjp(attnnb.topk_attention, q, k, v, top_k,
                                        backend="reference", **kw)
    assert_close(out, ref, np.float64, rtol=1e-12)
    assert_close(lse, ref_lse, np.float64, rtol=1e-12, what="lse")
    dout = rng.standard_normal(out.shape)
    got, want = pb(dout, np.zeros(lse.shape)), pb_ref(dout, np.zeros(lse.shape))
    assert got.keys() == want.keys()
    for name in want:  # (the score function's gradients: a tuple of its arrays')
        for g, w in zip(*((x,) if isinstance(x, np.ndarray) else x for x in (got[name],
                                                                            want[name]))):
            assert_close(g, w, np.float64, rtol=1e-12, what=name)


@pytest.mark.parametrize("normalizer", ["softmax", "sigmoid"])
def test_selection_bits_over_several_words(rng, normalizer):
    """The backward reads the forward's selection, one bit a key: rows of 45 keys (two
    words, a partial one), micro-tiles of two keys a thread (one word a row) and key
    tiles that end inside a word."""
    from attnnb.cuda import _micro

    old = _micro.set_micro_tiles((4, 8, 1, 2))
    try:
        q, k, v = qkv(rng, batch=(1,), hq=2, hk=1, lq=n(7), lk=n(45), d=4, dv=3,
                      dtype=np.float64, scale=1.5)
        kw = dict(normalizer=normalizer, causal=True, return_lse=True,
                  key_size=rng.integers(1, 3, (1, n(45))).astype(np.float64))
        _compare_vjp(attnnb.topk_attention, (q, k, v, 19), kw, np.float64, rng)
    finally:
        _micro.set_micro_tiles(old)


def test_a_backward_past_2_32_selection_words_is_refused():
    """The kernels index the selection's words with 32 bits: a problem with more is
    refused by name before anything is allocated."""
    from types import SimpleNamespace

    from attnnb.cuda.backward import topk_attention_vjp

    huge = SimpleNamespace(shape=(2, 1 << 12, 1, 1 << 15, 1000, 64, 64))  # 2**33 words
    with pytest.raises(NotImplementedError, match=r"past 2\*\*32 selection words"):
        topk_attention_vjp(huge, 8, None, None, None)

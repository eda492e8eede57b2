"""Self-check cases for :func:`attnnb.attention` (see :mod:`attnnb.checks`)."""

from __future__ import annotations

import numpy as np

from ..attention import attention
from . import data


def _case(seed, dtype, *, batch=(2,), hq=4, hk=2, lq=70, lk=131, d=16, dv=12, mask=None,
          bias=None, key_size=None, dropout_seed=None, **options):
    """A ``run(backend)`` computing ``attention(..., return_lse=True)`` on seeded data
    (``dropout_seed``: the dropout generator's ``seed``)."""
    q, k, v = data(seed, batch + (hq, lq, d), batch + (hk, lk, d), batch + (hk, lk, dv),
                   dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    extra = {}
    if mask is not None:
        extra["mask"] = rng.random(mask) < 0.7
    if bias is not None:
        extra["bias"] = rng.standard_normal(bias).astype(dtype)
    if key_size is not None:
        extra["key_size"] = rng.integers(1, 5, key_size).astype(dtype)
    if dropout_seed is not None:
        extra["seed"] = dropout_seed

    def run(backend):
        return attention(q, k, v, return_lse=True, backend=backend, **extra, **options)

    return run


def cases():
    """``(name, run)`` pairs: every option of ``attention``, float32 and float64."""
    out = []
    for dtype in (np.float32, np.float64):
        tag = np.dtype(dtype).name
        out += [
            (f"attention plain GQA {tag}", _case(1, dtype)),
            (f"attention causal Lq<Lk {tag}", _case(2, dtype, causal=True)),
            (f"attention causal Lq>Lk {tag}", _case(3, dtype, lq=77, lk=45, causal=True)),
            (f"attention mask (Lq,Lk) {tag}", _case(4, dtype, mask=(70, 131))),
            (f"attention mask+bias+causal {tag}",
             _case(5, dtype, mask=(2, 4, 1, 131), bias=(4, 70, 131), causal=True)),
            (f"attention key_size (B,N,1) {tag}", _case(6, dtype, key_size=(2, 131, 1))),
            (f"attention softmax1 {tag}", _case(7, dtype, normalizer="softmax1",
                                                mask=(70, 131))),
            (f"attention relu_expm1 {tag}", _case(8, dtype, normalizer="relu_expm1",
                                                  key_size=(2, 131), causal=True)),
            (f"attention 2-D scale=3 large logits {tag}", _case2d(9, dtype)),
            (f"attention D=40 Dv=80 N=197 {tag}", _case(10, dtype, batch=(1,), hq=2, hk=1,
                                                          lq=197, lk=197, d=40, dv=80)),
            (f"attention decoding Lq=3 Lk=700 causal {tag}",
             _case(11, dtype, lq=3, lk=700, causal=True, mask=(2, 1, 3, 700))),
            (f"attention dropout 0.3 causal {tag}",
             _case(12, dtype, causal=True, dropout_p=0.3, dropout_seed=12)),
            (f"attention sinks {tag}", _case(13, dtype, sinks=np.linspace(-1.0, 2.0, 4))),
            (f"attention sigmoid causal key_size {tag}",
             _case(14, dtype, normalizer="sigmoid", causal=True, key_size=(2, 131))),
            (f"attention softpick mask key_size {tag}",
             _case(15, dtype, normalizer="softpick", mask=(70, 131), key_size=(2, 131))),
        ]
    return out


def _case2d(seed, dtype):
    """2-D ``(L, D)`` inputs (one head), an explicit scale, ±large logits."""
    q, k, v = data(seed, (65, 3), (129, 3), (129, 5), dtype=dtype)
    q = q * 30.0  # logits of several hundred: the running maximum must hold

    def run(backend):
        return attention(q, k, v, scale=3.0, return_lse=True, backend=backend)

    return run

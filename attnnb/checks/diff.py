"""Self-check cases for :func:`attnnb.diff_attention` (see :mod:`attnnb.checks`).

Seeded data at small, awkward sizes (lengths not multiples of the tile,
``Lq != Lk``, GQA pairs, an empty row), every mode, float32 and float64.
"""

from __future__ import annotations

import numpy as np

from ..diff import diff_attention


def _case(seed, dtype, *, batch=(2,), h=4, hk=2, lq=70, lk=131, d=16, dv=12, lam="head",
          mask=None, bias=None, key_size=None, **options):
    """A ``run(backend)`` computing ``diff_attention`` on seeded data."""
    rng = np.random.default_rng(seed)

    def normal(shape):
        return rng.standard_normal(shape).astype(dtype)

    q, k, v = normal(batch + (2 * h, lq, d)), normal(batch + (2 * hk, lk, d)), normal(
        batch + (hk, lk, dv))
    lam_value = {"scalar": 0.8, "head": rng.uniform(0.1, 0.9, (h, 1)),
                 "token": rng.uniform(-0.5, 1.5, batch + (h, lq))}[lam]
    extra = {}
    if mask is not None:
        extra["mask"] = rng.random(mask) < 0.7
        extra["mask"][..., 3, :] = False  # an empty row
    if bias is not None:
        extra["bias"] = normal(bias)
    if key_size is not None:
        extra["key_size"] = rng.integers(1, 5, key_size).astype(dtype)

    def run(backend):
        return diff_attention(q, k, v, lam_value, backend=backend, **extra, **options)

    return run


def cases():
    """``(name, run)`` pairs: both modes, every option, float32 and float64."""
    out = []
    for dtype in (np.float32, np.float64):
        tag = np.dtype(dtype).name
        for mode in ("difference", "rectified"):
            out += [
                (f"diff {mode} GQA lam per head {tag}", _case(11, dtype, mode=mode)),
                (f"diff {mode} causal Lq>Lk lam per token {tag}",
                 _case(12, dtype, lq=77, lk=45, causal=True, lam="token", mode=mode)),
                (f"diff {mode} mask+bias+key_size {tag}",
                 _case(13, dtype, mask=(4, 70, 131), bias=(2, 1, 70, 131), key_size=(2, 131),
                       lam="scalar", mode=mode)),
                (f"diff {mode} 3-D one pair scale=2 {tag}",
                 _case(14, dtype, batch=(), h=1, hk=1, lq=65, lk=129, d=3, dv=5, scale=2.0,
                       mode=mode)),
            ]
        out.append((f"diff heaviside causal mask {tag}",
                    _case(15, dtype, causal=True, mask=(4, 70, 131), mode="heaviside")))
        out.append((f"diff rectified sinks per map {tag}",
                    _case(16, dtype, causal=True, mode="rectified",
                          sinks=np.linspace(-1.0, 2.0, 8).astype(dtype))))
    return out

"""Self-check cases for :func:`attnnb.sparse_attention` and :func:`attnnb.topk_attention`.

See :mod:`attnnb.checks`: each case is ``(name, run)`` with ``run(backend)``
computing on fixed seeded data and returning host arrays.
"""

from __future__ import annotations

import numpy as np

from .. import patterns
from ..sparse import sparse_attention, topk_attention


def _qkv(seed, dtype, batch=(2,), hq=4, hk=2, lq=70, lk=131, d=16, dv=12, integers=False):
    rng = np.random.default_rng(seed)
    shapes = (batch + (hq, lq, d), batch + (hk, lk, d), batch + (hk, lk, dv))
    if integers:  # exact logits with many ties: the top-k selection is the same everywhere
        q, k = (rng.integers(-2, 3, s).astype(dtype) for s in shapes[:2])
    else:
        q, k = (rng.standard_normal(s).astype(dtype) for s in shapes[:2])
    return q, k, rng.standard_normal(shapes[2]).astype(dtype)


def _sparse(seed, dtype, pattern, **options):
    q, k, v = _qkv(seed, dtype, lq=pattern.shape[0], lk=pattern.shape[1])

    def run(backend):
        return sparse_attention(q, k, v, pattern, return_lse=True, backend=backend, **options)

    return run


def _topk(seed, dtype, top_k, *, mask=False, **options):
    q, k, v = _qkv(seed, dtype, integers=True)
    extra = {}
    if mask:
        extra["mask"] = np.random.default_rng(seed + 1).random((70, 131)) < 0.6
    if "key_size" in options:
        options["key_size"] = np.random.default_rng(seed + 2).choice([1.0, 2.0, 4.0], 131)

    def run(backend):
        return topk_attention(q, k, v, top_k, scale=1.0, return_lse=True, backend=backend,
                              **extra, **options)

    return run


def cases():
    """``(name, run)`` pairs: pattern families, per-head patterns, normalizers; top-k."""
    rect = (70, 131)
    per_head = patterns.from_mask(np.random.default_rng(9).random((4,) + rect) < 0.15)
    out = []
    for dtype in (np.float32, np.float64):
        tag = np.dtype(dtype).name
        out += [
            (f"sparse local causal {tag}",
             _sparse(11, dtype, patterns.local(rect, 40, causal=True))),
            (f"sparse strided {tag}", _sparse(12, dtype, patterns.strided(rect, 7))),
            (f"sparse fixed {tag}", _sparse(13, dtype, patterns.fixed(rect, 16, 4))),
            (f"sparse bigbird key_size {tag}",
             _sparse(14, dtype, patterns.bigbird(131, 16, 1, 3, 2, seed=0),
                     key_size=np.arange(1, 132, dtype=dtype))),
            (f"sparse longformer softmax1 {tag}",
             _sparse(15, dtype, patterns.longformer(rect, 9, [0, 64]), normalizer="softmax1")),
            (f"sparse per-head relu_expm1 {tag}",
             _sparse(16, dtype, per_head, normalizer="relu_expm1")),
            (f"topk k=5 {tag}", _topk(21, dtype, 5)),
            (f"topk k=17 mask causal key_size {tag}",
             _topk(22, dtype, 17, mask=True, causal=True, key_size=True)),
            (f"topk k>=Lk {tag}", _topk(23, dtype, 500, causal=True)),
        ]
    return out

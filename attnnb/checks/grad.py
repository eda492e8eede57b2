"""Self-check cases for the gradients, :func:`attnnb.vjp` (see :mod:`attnnb.checks`).

Each case returns every gradient of one call, in name order, for a fixed
seeded cotangent (and LSE cotangent where the call returns the LSE).
"""

from __future__ import annotations

import numpy as np

from .. import patterns
from ..attention import attention
from ..diff import diff_attention
from ..sparse import sparse_attention, topk_attention
from ..vjp import vjp
from . import data


def _case(seed, dtype, fn, *, extra=(), lq=70, lk=131, hq=4, hk=2, dv=12, **options):
    hv = hk // 2 if fn is diff_attention else hk  # one value head per key pair
    q, k, v = data(seed, (2, hq, lq, 16), (2, hk, lk, 16), (2, hv, lk, dv), dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    if "key_size" in options:
        options["key_size"] = rng.integers(1, 4, options["key_size"]).astype(dtype)
    if "bias" in options:
        options["bias"] = rng.standard_normal(options["bias"]).astype(dtype)
    if "mask" in options:
        options["mask"] = rng.random(options["mask"]) < 0.7

    def run(backend):
        result, pullback = vjp(fn, q, k, v, *extra, backend=backend, **options)
        if options.get("return_lse"):
            out, lse = result
            grads = pullback(np.ones_like(out), np.full_like(lse, 0.5))
        else:
            grads = pullback(np.cos(np.arange(result.size)).reshape(result.shape)
                             .astype(result.dtype))
        return tuple(grads[name] for name in sorted(grads))

    return run


def cases():
    """``(name, run)`` pairs: the gradients of every function, float32 and float64."""
    out = []
    for dtype in (np.float32, np.float64):
        tag = np.dtype(dtype).name
        local = patterns.local((70, 131), 13) | patterns.longformer((70, 131), 0, [5])
        out += [
            (f"grad attention mask+bias+causal+key_size+dlse {tag}",
             _case(21, dtype, attention, mask=(70, 131), bias=(4, 1, 131), key_size=(2, 131),
                   causal=True, return_lse=True)),
            # two batches of four key heads: the one-sweep backward (attnnb/cpu/backward.py)
            (f"grad attention 8 key heads, one sweep {tag}",
             _case(29, dtype, attention, hq=8, hk=4, mask=(70, 131), bias=(8, 1, 131),
                   key_size=(2, 131), causal=True, return_lse=True)),
            # a mask array alone: the kernels a mask function's first calls run
            # (attnnb/cpu/_first_tier.py)
            (f"grad attention mask {tag}", _case(30, dtype, attention, mask=(70, 131))),
            (f"grad attention softmax1 {tag}", _case(22, dtype, attention, normalizer="softmax1")),
            (f"grad attention relu_expm1 {tag}",
             _case(23, dtype, attention, normalizer="relu_expm1", causal=True)),
            (f"grad sparse_attention {tag}",
             _case(24, dtype, sparse_attention, extra=(local,), return_lse=True)),
            (f"grad topk_attention {tag}", _case(25, dtype, topk_attention, extra=(9,),
                                                 causal=True)),
            (f"grad diff_attention {tag}",
             _case(26, dtype, diff_attention, extra=(0.4,), bias=(70, 131), causal=True)),
            (f"grad diff_attention rectified {tag}",
             _case(28, dtype, diff_attention, extra=(0.6,), bias=(70, 131), key_size=(2, 131),
                   causal=True, mode="rectified")),
        ]
    return out

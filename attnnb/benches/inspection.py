"""Benchmark cases: looking inside attention (see ``python -m attnnb bench``).

The statistics pass (:func:`attnnb.attention_stats`, every statistic) against
the cpu forward of the same call, and :func:`attnnb.weights` of 64 rows of a
long problem against one forward at the same size: each figure the median
time (ms) of one fresh process, the rounds alternating the candidates.
"""

from __future__ import annotations

from .attention import run_python, timed_tail

_SCRIPT = r"""
import sys, time
import numpy as np
import attnnb
what = sys.argv[1]
B, H, N, D, causal, rounds = (int(x) for x in sys.argv[2:8])
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((B, H, N, D)).astype(np.float32) for _ in range(3))
kw = dict(causal=bool(causal))

def call():
    if what == "forward":
        return attnnb.attention(q, k, v, backend="cpu", **kw)
    if what == "weights of 64 rows":
        return attnnb.weights(attnnb.attention, q, k, v, rows=slice(N - 64, N), **kw)
    return attnnb.attention_stats(attnnb.attention, q, k, v, stats=attnnb.inspection.STATS,
                                  keys=[0], **kw)
""" + timed_tail("call", "rounds")


def _ms(what, shape, rounds):
    return run_python(_SCRIPT, what, *shape, rounds)


def cases(quick: bool) -> list[dict]:
    rounds = 2 if quick else 5
    stats_shape = (1, 2, 256, 64, 1) if quick else (1, 8, 4096, 64, 1)
    rows_shape = (1, 2, 1024, 64, 1) if quick else (1, 8, 32768, 64, 1)
    out = []
    for shape, other in ((stats_shape, "attention_stats"), (rows_shape, "weights of 64 rows")):
        B, H, N, D, causal = shape
        cands = {w: (lambda w=w, s=shape: _ms(w, s, rounds)) for w in ("forward", other)}
        out.append({"name": f"{other} against the cpu forward, f32 B={B} H={H} N={N} D={D}"
                            f"{' causal' if causal else ''} (ms, fresh processes)",
                    "work": None, "candidates": cands, "measure": "value", "unit": "ms",
                    "repeats": 1 if quick else 2})
    return out

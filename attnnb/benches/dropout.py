"""Benchmark cases: the cost of attention dropout (see ``python -m attnnb bench``).

Dense attention on the cpu backend, forward and forward + backward
(:func:`attnnb.vjp`), float32, with ``dropout_p`` 0 against 0.1: each
figure is the median time (ms) of one fresh process, the rounds alternating
the candidates, so that their ratio is the price of regenerating the keep
decisions tile by tile (once in the forward, once per backward sweep).
"""

from __future__ import annotations

from .attention import run_python, timed_tail

_SCRIPT = r"""
import sys, time
import numpy as np
import attnnb
p, what = float(sys.argv[1]), sys.argv[2]
B, H, N, D, causal, rounds = (int(x) for x in sys.argv[3:9])
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((B, H, N, D)).astype(np.float32) for _ in range(3))
kw = dict(causal=bool(causal), dropout_p=p, seed=1 if p else None, backend="cpu")

def call():
    if what == "forward":
        return attnnb.attention(q, k, v, **kw)
    out, pullback = attnnb.vjp(attnnb.attention, q, k, v, **kw)
    return pullback(out)
""" + timed_tail("call", "rounds")

SHAPES = ((1, 8, 2048, 64, 0), (1, 8, 2048, 128, 0), (1, 8, 2048, 64, 1))


def _ms(p, what, shape, rounds):
    return run_python(_SCRIPT, p, what, *shape, rounds)


def cases(quick: bool) -> list[dict]:
    rounds = 3 if quick else 10
    shapes = ((1, 2, 256, 64, 0),) if quick else SHAPES
    out = []
    for shape in shapes:
        B, H, N, D, causal = shape
        for what in ("forward", "forward+backward"):
            cands = {f"dropout {p}": (lambda p=p, w=what, s=shape: _ms(p, w, s, rounds))
                     for p in (0.0, 0.1)}
            out.append({"name": f"cpu {what} f32 B={B} H={H} N={N} D={D}"
                                f"{' causal' if causal else ''} (ms, fresh processes)",
                        "work": None, "candidates": cands, "measure": "value", "unit": "ms",
                        "repeats": 1 if quick else 3})
    return out

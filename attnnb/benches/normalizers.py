"""Benchmark cases: the normalizers against softmax (see ``python -m attnnb bench``).

Dense attention on the cpu backend, float32, B = 1, H = 8, N = 2048, causal,
forward and forward + backward (:func:`attnnb.vjp`), with ``normalizer``
``softmax`` (the first candidate), ``relu_expm1``, ``sigmoid`` and
``softpick``, and softmax with learned ``sinks``: the ratios are each one's
extra elementwise work (target: at most 1.15x softmax's time).
"""

from __future__ import annotations

import numpy as np

NORMALIZERS = ("softmax", "relu_expm1", "sigmoid", "softpick")
SINKS = np.linspace(-1.0, 1.0, 8)  # one per head


def data(N, D, seed=0):
    """``q, k, v`` of shape ``(1, 8, N, D)``, float32."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((1, 8, N, D)).astype(np.float32) for _ in range(3))


def case(N, D, backward):
    from attnnb import attention, vjp

    q, k, v = data(N, D)

    def run(normalizer, **sinks):
        if not backward:
            return attention(q, k, v, causal=True, normalizer=normalizer, backend="cpu", **sinks)
        out, pullback = vjp(attention, q, k, v, causal=True, normalizer=normalizer,
                            backend="cpu", **sinks)
        return pullback(out)

    flops = 4.0 * 8 * N * N * D / 2 * (3.5 if backward else 1.0)
    what = "forward+backward" if backward else "forward"
    return {"name": f"normalizers {what} f32 H=8 N={N} D={D} causal", "work": flops,
            "candidates": {**{n: (lambda n=n: run(n)) for n in NORMALIZERS},
                           "sinks": lambda: run("softmax", sinks=SINKS)}}


def cases(quick: bool) -> list[dict]:
    """``{"name", "work", "candidates"}`` for ``python -m attnnb bench``."""
    sizes = ((256, 64),) if quick else ((2048, 64), (2048, 128))
    return [case(N, D, backward) for N, D in sizes for backward in (False, True)]

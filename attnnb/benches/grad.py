"""Benchmark cases for the gradients (see ``python -m attnnb bench``).

Forward + backward of dense attention through :func:`attnnb.vjp` against
PyTorch's ``scaled_dot_product_attention`` forward + backward on the same
data (``requires_grad`` inputs), float32, ``B = 1, H = 8, D = 64``.  The work
counted is 3.5x the forward's (forward 1x, backward 2.5x: five products
instead of two), so GFLOP/s of the two columns compare directly.  A second
row times the backward alone (the pullback of a saved forward, 2.5x), and
the last the peak-RSS growth of a causal backward at long length.
"""

from __future__ import annotations

import numpy as np

import attnnb

from .attention import HEADS, MEMORY_PREAMBLE, D, _torch, attention_flops, run_python

_MEMORY_SCRIPT = MEMORY_PREAMBLE + r"""
small = rng.standard_normal((1, 1, 130, 64)).astype(np.float32)
_, pb = attnnb.vjp(attnnb.attention, small, small, small, causal=True, backend="cpu")
pb(small)  # load the kernels
q, k, v, do = (rng.standard_normal((1, 1, n, 64)).astype(np.float32) for _ in range(4))
out, pullback = attnnb.vjp(attnnb.attention, q, k, v, causal=True, backend="cpu")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status_kib("VmRSS")
grads = pullback(do)
print((status_kib("VmHWM") - before) / 1024.0)
"""


def peak_rss_growth_mib(n):
    """Peak-RSS growth (MiB) of one causal backward, N=n, one head, D=64 (Linux)."""
    return run_python(_MEMORY_SCRIPT, n)


def _forward_backward(q, k, v, do, causal):
    _, pullback = attnnb.vjp(attnnb.attention, q, k, v, causal=causal, backend="cpu")
    return pullback(do)


def _speed_cases(sizes):
    torch, F = _torch()
    rng = np.random.default_rng(0)
    cases = []
    for causal in (False, True):
        for n in sizes:
            q, k, v, do = (rng.standard_normal((1, HEADS, n, D)).astype(np.float32)
                           for _ in range(4))
            fwd = attention_flops(1, HEADS, n, n, D, D, causal)
            cands = {"attnnb-cpu": (lambda q=q, k=k, v=v, do=do, c=causal:
                                    _forward_backward(q, k, v, do, c))}
            if torch is not None:
                tq, tk, tv = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
                tdo = torch.from_numpy(do)

                def sdpa(tq=tq, tk=tk, tv=tv, tdo=tdo, c=causal):
                    out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=c)
                    return torch.autograd.grad(out, (tq, tk, tv), tdo)

                cands["torch"] = sdpa
            tag = f"f32 B=1 H={HEADS} N={n} D={D}{' causal' if causal else ''}"
            cases.append({"name": f"attention fwd+bwd {tag}", "work": 3.5 * fwd,
                          "candidates": cands})
            _, pullback = attnnb.vjp(attnnb.attention, q, k, v, causal=causal, backend="cpu")
            cases.append({"name": f"attention bwd only {tag}", "work": 2.5 * fwd,
                          "candidates": {"attnnb-cpu": lambda p=pullback, do=do: p(do)}})
    return cases


def cases(quick: bool) -> list[dict]:
    sizes = (256,) if quick else (1024, 2048, 4096)
    mem_n = 4096 if quick else 32768
    out = _speed_cases(sizes)
    out.append({
        "name": f"peak RSS growth, causal backward N={mem_n} H=1 D=64 f32", "work": None,
        "measure": "value", "unit": "MiB", "repeats": 1,
        "candidates": {"attnnb-cpu": lambda: peak_rss_growth_mib(mem_n)},
    })
    return out

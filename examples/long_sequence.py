"""Sparse attention on a long sequence: pattern families, their cost and their error.

A sequence of N = 4096 tokens whose hidden states drift slowly (a random
walk), so that nearby tokens resemble each other and attention is mostly
local, as in text or audio.  For each standard pattern family the script
prints

* its density (allowed fraction of the N x N grid),
* the time of ``sparse_attention`` and its speed-up over dense attention,
* its error against dense attention with the pattern as a mask (the same
  function, computed the slow way: zero up to rounding), and
* how far its output is from full dense attention (what the sparsity costs
  in accuracy on this data),

then top-k attention for comparison, and saves a picture of the patterns to
``examples/out/long_sequence_patterns.png``.  Runs in well under a minute
on two cores.

    python examples/long_sequence.py
"""

from __future__ import annotations

import os
import time

import numpy as np

import attnnb
from attnnb import patterns

N, H, D = 4096, 4, 64
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def sequence(seed=0, rho=0.98):
    """q, k, v ``(H, N, D)`` float32 from a slowly drifting hidden state.

    The state is a stationary AR(1) process (correlation ``rho ** |i - j|``,
    about 50 tokens); queries, keys (plus noise) and values are projections
    of it, so a query's logits are largest for the tokens around it and
    nearby values are alike.
    """
    rng = np.random.default_rng(seed)
    x = np.empty((N, D))
    x[0] = rng.standard_normal(D)
    noise = rng.standard_normal((N, D)) * np.sqrt(1 - rho**2)
    for t in range(1, N):
        x[t] = rho * x[t - 1] + noise[t]
    w = np.linalg.qr(rng.standard_normal((H, D, D)))[0] * D**0.25
    q = np.einsum("nc,hcd->hnd", x, w)
    k = q + 0.3 * rng.standard_normal(q.shape)
    v = np.einsum("nc,hcd->hnd", x, np.linalg.qr(rng.standard_normal((H, D, D)))[0])
    q = q * 0.15  # temperature: a query's weight spreads over roughly a hundred tokens
    return q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)


def families():
    """The patterns compared, at roughly similar densities (causal where the family is)."""
    return {
        "local w=128 (causal)": patterns.local(N, 128, causal=True),
        "strided 64 + local 63 (Sparse Transformer)":
            patterns.strided(N, 64) | patterns.local(N, 63, causal=True),
        "fixed block 128, summary 16": patterns.fixed(N, 128, 16),
        "dilated w=64, d=2": patterns.dilated(N, 64, 2),
        "longformer w=128, 4 global": patterns.longformer(N, 128, [0, 1, 2, 3]),
        "bigbird b=64 g=1 w=3 r=2": patterns.bigbird(N, 64, 1, 3, 2, seed=0),
    }


def timed(fn, repeats=2):
    best = np.inf
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return out, best


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
    q, k, v = sequence()
    pats = families()
    attnnb.attention(q[:, :64], k[:, :64], v[:, :64])  # compile outside the timings
    attnnb.sparse_attention(q[:, :64], k[:, :64], v[:, :64], patterns.local(64, 4))
    dense, t_dense = timed(lambda: attnnb.attention(q, k, v))
    dense_causal = attnnb.attention(q, k, v, causal=True)
    print(f"N={N}, H={H}, D={D}, float32, cpu; dense attention {t_dense * 1e3:.0f} ms")
    print(f"{'pattern':44s} {'density':>8s} {'ms':>7s} {'speed-up':>8s} "
          f"{'err vs masked':>13s} {'dist. to dense':>14s}")
    for name, p in pats.items():
        p.blocks()
        out, t = timed(lambda p=p: attnnb.sparse_attention(q, k, v, p))
        masked = attnnb.attention(q, k, v, mask=p.to_mask())
        causal = p.nnz == (p & patterns.local(N, N, causal=True)).nnz
        target = dense_causal if causal else dense
        print(f"{name:44s} {p.density:8.4f} {t * 1e3:7.0f} {t_dense / t:7.1f}x "
              f"{rel(out, masked):13.1e} {rel(out, target):14.3f}"
              + ("  (vs causal dense)" if causal else ""))
    for top_k in (32, 128):
        out, t = timed(lambda top_k=top_k: attnnb.topk_attention(q, k, v, top_k, causal=True),
                       repeats=1)
        print(f"{'top-k k=' + str(top_k) + ' (causal)':44s} {top_k / N:8.4f} {t * 1e3:7.0f} "
              f"{t_dense / t:7.1f}x {'':>13s} {rel(out, dense_causal):14.3f}  (vs causal dense)")
    save_picture(pats)


def save_picture(pats):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no picture")
        return
    fig, axes = plt.subplots(2, 3, figsize=(12, 8.5))
    for ax, (name, p) in zip(axes.ravel(), pats.items(), strict=True):
        p.plot(ax=ax, max_pixels=256, title=f"{name}\ndensity {p.density:.3f}")
        ax.title.set_fontsize(9)
    fig.suptitle(f"Sparse attention patterns, N = {N} (darker = more allowed pairs per pixel)")
    fig.tight_layout()
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "long_sequence_patterns.png")
    fig.savefig(path, dpi=90)
    print(f"saved {path}")


if __name__ == "__main__":
    main()

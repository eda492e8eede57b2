"""Inside attention: the seeds' three facts, measured on the weights themselves.

The discussions attnnb grew from are about what happens to the attention
weights; :func:`attnnb.weights` recomputes them exactly from any call and
:func:`attnnb.attention_stats` reduces them without an ``(Lq, Lk)`` array.

1. **A merged token counts twice.**  Proportional attention with
   ``key_size=2`` gives a merged key what its two copies receive together:
   ``2 exp(q.k1) / (2 exp(q.k1) + exp(q.k3))``.
2. **Sparse attention renormalises.**  Keeping tokens 2 and 4 of a row whose
   dense weights are ``(0.1, 0.4, 0.2, 0.3)`` turns 0.40 into ``0.40 / 0.70 =
   0.57``: every kept weight rises by the dense mass the row lost.
3. **A difference of softmaxes leaves the convex hull.**  Differential
   attention's weights ``A1 - lam A2`` can be negative, so its output can lie
   outside the convex hull of the values (it leaves their bounding box);
   a softmax head's cannot (values in the plane, so that the hull is exact).

Then the share of exactly-zero and negative weights per variant, and a
picture of a few rows' weights of each: ``examples/out/inside_attention.png``.
Runs in a few seconds (``pip install scipy matplotlib``).
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import attnnb
from attnnb import patterns

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
N, D = 64, 16


def merged_token_counts_twice(rng):
    q, k, v = (rng.standard_normal((1, 6, D)) for _ in range(3))
    sizes = np.array([2.0, 1, 1, 1, 1, 1])
    merged = attnnb.weights(attnnb.attention, q, k, v, key_size=sizes)
    twice = attnnb.weights(attnnb.attention, q, np.concatenate([k[:, :1], k], 1),
                           np.concatenate([v[:, :1], v], 1))
    gap = max(np.abs(merged[..., 0] - twice[..., :2].sum(-1)).max(),
              np.abs(merged[..., 1:] - twice[..., 2:]).max())
    print(f"1. key_size=2 against the key twice: largest difference {gap:.1e} "
          f"(first query: {merged[0, 0, 0]:.4f} = {twice[0, 0, 0]:.4f} + {twice[0, 0, 1]:.4f})")


def sparse_renormalises(rng):
    dense_row = np.array([0.1, 0.4, 0.2, 0.3])
    zero = np.zeros((1, 4, 1))
    bias = np.log(dense_row)[None, :]
    dense = attnnb.weights(attnnb.attention, zero[:, :1], zero, zero, bias=bias)[0, 0]
    kept = attnnb.weights(attnnb.attention, zero[:, :1], zero, zero, bias=bias,
                          mask=np.array([[False, True, False, True]]))[0, 0]
    print(f"2. dense weights {np.round(dense, 2)}; tokens 2 and 4 kept: {np.round(kept, 4)} "
          f"(0.40 / 0.70 = {0.4 / 0.7:.4f})")
    q, k, v = (rng.standard_normal((1, N, D)) for _ in range(3))
    window = patterns.local(N, 4)
    dense = attnnb.weights(attnnb.attention, q, k, v)
    sparse = attnnb.weights(attnnb.sparse_attention, q, k, v, window)
    keep = window.to_mask()
    lost = 1 - np.where(keep, dense, 0).sum(-1, keepdims=True)
    rise = np.where(keep, sparse / dense, np.nan)
    err = np.nanmax(np.abs(rise - 1 / (1 - lost)) * (1 - lost))
    print(f"   a window of 9 keys over {N}: each kept weight times 1 / (1 - lost mass), "
          f"largest error {err:.1e}")


def leaves_the_hull(rng):
    # sharp maps (logits of standard deviation 4): each map picks out a few keys
    q = rng.standard_normal((1, 2, N, D)) * 2.0
    k = rng.standard_normal((1, 2, N, D)) * 2.0
    v = rng.standard_normal((1, 1, N, 2))
    lam = 0.8
    from scipy.spatial import Delaunay

    hull = Delaunay(v[0, 0])
    outside = {}
    for name, out in (("softmax", attnnb.attention(q[:, :1], k[:, :1], v)),
                      ("difference", attnnb.diff_attention(q, k, v, lam)),
                      ("rectified", attnnb.diff_attention(q, k, v, lam, mode="rectified"))):
        # values in the plane: the hull's triangulation says inside or out
        outside[name] = float((hull.find_simplex(out[0, 0]) < 0).mean())
    print("3. rows whose output leaves the convex hull of the values: "
          + ", ".join(f"{n} {100 * s:.0f} %" for n, s in outside.items()))
    return q, k, v, lam


def variants(q, k, v, lam):
    """``{name: (call, kwargs)}`` of the variants compared: one head (or pair) each."""
    q1, k1 = q[:, :1], k[:, :1]
    return {
        "softmax": ((attnnb.attention, q1, k1, v), dict(causal=True)),
        "relu_expm1": ((attnnb.attention, q1, k1, v), dict(causal=True,
                                                            normalizer="relu_expm1")),
        "top-8": ((attnnb.topk_attention, q1, k1, v, 8), dict(causal=True)),
        "window 8": ((attnnb.sparse_attention, q1, k1, v,
                      patterns.local(N, 8, causal=True)), {}),
        "difference": ((attnnb.diff_attention, q, k, v, lam), dict(causal=True)),
        "rectified": ((attnnb.diff_attention, q, k, v, lam), dict(causal=True,
                                                                  mode="rectified")),
    }


def shares(cases):
    print(f"\n{'variant':<12} {'exact zeros':>12} {'negative':>9} {'entropy':>8}")
    table = {}
    for name, (call, kw) in cases.items():
        w = attnnb.weights(*call, **kw)
        allowed = np.tril(np.ones((N, N), bool))
        s = attnnb.attention_stats(*call, stats=("zeros", "entropy"), **kw)
        zeros = s["zeros"].sum() / allowed.sum()
        negative = (w < 0).sum() / allowed.sum()
        table[name] = (zeros, negative)
        print(f"{name:<12} {100 * zeros:>11.1f}% {100 * negative:>8.1f}% "
              f"{s['entropy'].mean():>8.2f}")
    print("(shares of the causal (query, key) pairs; entropy in nats, mean over rows)")
    return table


def plot(cases, path, rows=slice(40, 56), keys=slice(0, 56)):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cases), figsize=(2.6 * len(cases), 3.2),
                             constrained_layout=True)
    for ax, (name, (call, kw)) in zip(axes, cases.items()):
        w = attnnb.weights(*call, rows=rows, **kw)[0, 0][:, keys]
        bound = np.abs(w).max()
        im = ax.imshow(w, cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto",
                       interpolation="nearest", extent=(keys.start - 0.5, keys.stop - 0.5,
                                                        rows.stop - 0.5, rows.start - 0.5))
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("key")
        fig.colorbar(im, ax=ax, shrink=0.8)
    axes[0].set_ylabel("query")
    fig.suptitle("attnnb.weights: rows 40-55 of one causal head (red > 0 > blue)",
                 fontsize=11)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"\nsaved {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(OUT_DIR, "inside_attention.png"))
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    merged_token_counts_twice(rng)
    sparse_renormalises(rng)
    q, k, v, lam = leaves_the_hull(rng)
    cases = variants(q, k, v, lam)
    shares(cases)
    if not args.no_plot:
        plot(cases, args.out)


if __name__ == "__main__":
    main()

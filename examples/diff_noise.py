"""Differential attention cancels attention noise: a planted key among many distractors.

Two parts:

1. ``DiffAttention``: the paper's layer (Ye et al. 2024, ``MultiheadDiffAttn``)
   in NumPy on top of :func:`attnnb.diff_attention`: projections, the packed
   ``(2H, d)`` / ``(2Hk, d)`` / ``(Hk, 2d)`` layout, the re-parameterised
   lambda, ``subln`` and the output projection (rotary embeddings left out).
   It is checked against the reference's FlashAttention composition
   (``multihead_flashdiff_1``: two ``attention()`` calls, subtracted).

2. A synthetic retrieval task.  Every query has one planted key (its
   "needle") among ``LK - 1`` distractors that share a "topic" direction
   with the query.  The first map sees needle and topic, the second map the
   topic only, so the attention the topic draws (the noise) is common to
   both maps.  We compare the weights of softmax, differential, rectified
   differential, ``softmax1`` and ``relu_expm1`` attention (the last two
   through ``attnnb.attention(normalizer=...)`` on the first map): the mass
   on the planted key versus the rest, and whether each output lies in the
   convex hull of the values (a linear-programming feasibility test).
   Weights are read off by multiplying with ``v = identity``.

Saves ``examples/out/diff_noise.png``.  Runs in well under a minute.
"""

from __future__ import annotations

import os
import time

import numpy as np
from scipy.optimize import linprog

import attnnb
from attnnb.diff import lambda_init, reparam_lambda, subln

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


class DiffAttention:
    """``MultiheadDiffAttn`` of the reference in NumPy (no rotary embedding).

    ``num_heads`` is the number of head *pairs* (half the heads of the
    Transformer it replaces), ``num_kv_heads`` the number of key pairs.
    """

    def __init__(self, embed_dim, depth, num_heads, num_kv_heads=None, *, seed=0):
        rng = np.random.default_rng(seed)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        n_rep = self.num_heads // self.num_kv_heads
        self.head_dim = embed_dim // num_heads // 2
        d = self.head_dim

        def linear(n_in, n_out):
            return (rng.uniform(-1, 1, (n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)

        self.q_proj = linear(embed_dim, embed_dim)
        self.k_proj = linear(embed_dim, embed_dim // n_rep)
        self.v_proj = linear(embed_dim, embed_dim // n_rep)
        self.out_proj = linear(embed_dim, embed_dim)
        self.lambda_init = lambda_init(depth)
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            rng.normal(0, 0.1, d).astype(np.float32) for _ in range(4))
        self.subln_weight = np.ones(2 * d, np.float32)

    def lam(self):
        return reparam_lambda(self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2,
                              self.lambda_init)

    def packed_qkv(self, x):
        """``x (B, L, E)`` -> q ``(B, 2H, L, d)``, k ``(B, 2Hk, L, d)``, v ``(B, Hk, L, 2d)``."""
        B, L, _ = x.shape
        d, H, Hk = self.head_dim, self.num_heads, self.num_kv_heads
        q = (x @ self.q_proj).reshape(B, L, 2 * H, d).transpose(0, 2, 1, 3)
        k = (x @ self.k_proj).reshape(B, L, 2 * Hk, d).transpose(0, 2, 1, 3)
        v = (x @ self.v_proj).reshape(B, L, Hk, 2 * d).transpose(0, 2, 1, 3)
        return q, k, v

    def __call__(self, x):
        B, L, _ = x.shape
        q, k, v = self.packed_qkv(x)
        attn = attnnb.diff_attention(q, k, v, self.lam(), causal=True)  # (B, H, L, 2d)
        attn = subln(attn, self.subln_weight, lambda_init=self.lambda_init)
        attn = attn.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return attn @ self.out_proj

    def flashdiff_1(self, x):
        """The reference's FlashAttention composition: two attention() calls, subtracted."""
        B, L, _ = x.shape
        q, k, v = self.packed_qkv(x)
        attn1 = attnnb.attention(q[:, 0::2], k[:, 0::2], v, causal=True)
        attn2 = attnnb.attention(q[:, 1::2], k[:, 1::2], v, causal=True)
        attn = subln(attn1 - self.lam() * attn2, self.subln_weight, lambda_init=self.lambda_init)
        return attn.transpose(0, 2, 1, 3).reshape(B, L, -1) @ self.out_proj


# ---------------------------------------------------------------- retrieval task
LQ, LK, D, DV = 16, 512, 32, 4
TOPIC, NOISE = 2.0, 0.1
LAM = 0.8  # lambda_init of a deep layer; the paper's lambda settles near it


def retrieval_task(seed=0):
    """q ``(2, LQ, D)`` (one head pair), k ``(2, LK, D)``, values ``(1, LK, DV)``, planted keys."""
    rng = np.random.default_rng(seed)
    basis, _ = np.linalg.qr(rng.standard_normal((D, D)))
    topic, needles = basis[0], basis[1 : 1 + LQ]
    planted = rng.choice(LK, LQ, replace=False)
    affinity = rng.standard_normal(LK)  # how much each token is "on topic": the noise
    affinity[planted] = 0.0
    keys = affinity[:, None] * topic + NOISE * rng.standard_normal((LK, D)) / np.sqrt(D)
    keys[planted] += needles
    # the needle's logit margin gives the planted key 1 - LAM of map 1's softmax mass; the
    # distractors draw the rest (the noise)
    others = np.delete(affinity, planted)
    needle = np.log((1 - LAM) / LAM * np.exp(TOPIC * others).sum())
    q1 = needle * needles + TOPIC * topic  # map 1: needle and topic
    q2 = np.broadcast_to(TOPIC * topic, (LQ, D))  # map 2: the topic only
    q = np.stack([q1, q2])
    k = np.stack([keys, keys])
    # values share an offset, as the values of a real layer often do
    values = 0.5 * rng.standard_normal((1, LK, DV)) + np.array([3.0, 0.0, 0.0, 0.0])
    return q, k, values, planted


def weights_and_outputs(q, k, values):
    """Each method's ``(LQ, LK)`` weights (via ``v = I``) and ``(LQ, DV)`` outputs."""
    eye = np.eye(LK)[None]
    methods = {}
    for name, mode in (("differential", "difference"), ("rectified", "rectified")):
        methods[name] = lambda v, mode=mode: attnnb.diff_attention(q, k, v, LAM, scale=1.0,
                                                                   mode=mode)[0]
    for normalizer in ("softmax", "softmax1", "relu_expm1"):
        methods[normalizer] = lambda v, n=normalizer: attnnb.attention(q[:1], k[:1], v,
                                                                       scale=1.0, normalizer=n)[0]
    order = ("softmax", "differential", "rectified", "softmax1", "relu_expm1")
    return {m: (methods[m](eye), methods[m](values)) for m in order}


def in_convex_hull(point, points):
    """True when ``point`` is a convex combination of the rows of ``points`` (an LP)."""
    n = points.shape[0]
    a_eq = np.vstack([points.T, np.ones((1, n))])
    b_eq = np.r_[point, 1.0]
    res = linprog(np.zeros(n), A_eq=a_eq, b_eq=b_eq, bounds=(0, None), method="highs")
    return res.status == 0


def report(results, values, planted):
    rows = np.arange(LQ)
    print(f"\n{'method':<13} {'planted':>8} {'rest |w|':>9} {'planted/rest':>13} {'sum w':>7} "
          f"{'outside hull':>13}")
    stats = {}
    for name, (w, out) in results.items():
        on = w[rows, planted]
        rest = np.abs(w).sum(axis=1) - np.abs(on)
        outside = sum(not in_convex_hull(out[i], values[0]) for i in range(LQ))
        stats[name] = (on.mean(), rest.mean())
        print(f"{name:<13} {on.mean():8.3f} {rest.mean():9.3f} {on.mean() / rest.mean():13.2f} "
              f"{w.sum(axis=1).mean():7.3f} {outside:>10d}/{LQ}")
    return stats


def plot(results, planted, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import SymLogNorm

    names = list(results)
    fig, axes = plt.subplots(2, len(names), figsize=(4.4 * len(names), 7),
                             gridspec_kw={"height_ratios": [3, 2]}, layout="constrained")
    order = np.argsort(planted)  # queries sorted by their planted key: a visible diagonal
    norm = SymLogNorm(linthresh=1e-3, vmin=-0.5, vmax=0.5)
    for col, name in enumerate(names):
        w = results[name][0]
        im = axes[0, col].imshow(w[order], aspect="auto", cmap="RdBu_r", norm=norm,
                                 interpolation="nearest")
        axes[0, col].set_title(name)
        axes[0, col].set_xlabel("key")
        axes[0, 0].set_ylabel("query (sorted by planted key)")
        q0 = order[0]
        axes[1, col].plot(w[q0], lw=0.6)
        axes[1, col].axvline(planted[q0], color="C3", lw=0.8, ls=":")
        axes[1, col].set_ylim(-0.01, 0.02)
        axes[1, col].set_xlabel("key")
        on = w[q0, planted[q0]]
        axes[1, col].set_title(f"query {q0}: planted key (dotted) has {on:.2f}", fontsize=9)
    axes[1, 0].set_ylabel("weight (zoomed in on the noise)")
    fig.colorbar(im, ax=axes[0, -1], label="weight (symlog)")
    fig.suptitle(f"A planted key among {LK - 1} distractors: weights of five attention "
                 f"variants (differential: lambda = {LAM})")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)


def main():
    t0 = time.perf_counter()
    layer = DiffAttention(embed_dim=128, depth=5, num_heads=4, num_kv_heads=2)
    x = np.random.default_rng(1).standard_normal((2, 70, 128)).astype(np.float32)
    y = layer(x)
    ref = layer.flashdiff_1(x)
    err = np.abs(y - ref).max() / np.abs(ref).max()
    print(f"DiffAttention layer: x {x.shape} -> {y.shape}, lambda = {layer.lam():.4f}, "
          f"lambda_init = {layer.lambda_init:.4f}; vs flashdiff_1 composition: "
          f"max rel. diff {err:.1e}")

    q, k, values, planted = retrieval_task()
    results = weights_and_outputs(q, k, values)
    report(results, values, planted)
    path = os.path.join(OUT_DIR, "diff_noise.png")
    plot(results, planted, path)
    print(f"\nsaved {path} ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()

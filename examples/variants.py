"""Length extrapolation: one attention layer trained with four score functions.

The task: every token ``t`` of a sequence carries a random unit code and a
random value ``u_t``; the target at position ``i`` is ``u_{i-1}``, the value
of the token just before.  Attention over the earlier tokens (a user's mask
function, ``j < i``) sees the codes and values but no positions, so it has
to find the previous token by position alone.  Four score functions:

* ``none``: no score function (the layer has no way to tell positions apart:
  it can only average);
* ``alibi``: ``s + m_h (j - i)`` with learned slopes ``m_h``
  (:func:`attnnb.mods.alibi`);
* ``t5``: ``s + table[bucket(j - i), h]``, a learned table over T5's
  logarithmic buckets (:func:`attnnb.mods.relative_bias`);
* ``forgetting``: ``s + c_i - c_j`` with ``c`` the running sum of
  data-dependent log forget gates ``log f_t = -softplus(x_t w_h + b_h)`` (the
  Forgetting Transformer; :func:`attnnb.mods.forgetting`).

The layer is trained at length 64 and evaluated at 64, 256 and 1024.  ALiBi
and the forgetting gates carry what they learned to any length; T5's table
fits length 64 as well but not beyond, since the buckets of distances never
seen in training keep their initial 0 and draw weight to far tokens.  Every
gradient, the score functions' arrays' included (slopes, table, gates),
comes from :func:`attnnb.vjp` (cpu backend, float64); the projections'
follow in a few lines of NumPy.

Saves ``examples/out/variants.png`` and prints the table.  About a minute
on two cores with an empty kernel cache (each score function compiles its
own kernels once), a few seconds after.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import attnnb
from attnnb import mods

D_CODE, D_VALUE, H, DH = 16, 8, 2, 16
TRAIN_LEN, EVAL_LENS = 64, (64, 256, 1024)


def strictly_before(b, h, i, j):
    """The mask function: the tokens before ``i``."""
    return j < i


def batch(rng, n, length):
    codes = rng.standard_normal((n, length, D_CODE))
    codes /= np.linalg.norm(codes, axis=-1, keepdims=True)
    values = rng.standard_normal((n, length, D_VALUE))
    x = np.concatenate([codes, values], axis=-1)
    return x, values


class Layer:
    """``attention(x Wq, x Wk, x Wv) Wo`` with one score function, and its parameters."""

    def __init__(self, variant, rng):
        d_in = D_CODE + D_VALUE
        init = lambda *shape: rng.standard_normal(shape) / np.sqrt(shape[0])  # noqa: E731
        self.variant = variant
        self.p = {"Wq": init(d_in, H * DH), "Wk": init(d_in, H * DH), "Wv": init(d_in, H * DH),
                  "Wo": init(H * DH, D_VALUE)}
        if variant == "alibi":
            self.p["slopes"] = np.full(H, 0.05)
        elif variant == "t5":
            self.p["table"] = np.zeros((32, H))
        elif variant == "forgetting":
            self.p["Wf"] = np.zeros((d_in, H))
            self.p["bf"] = np.full(H, 1.0)

    def score_mod(self, x):
        """The score function for inputs ``x (n, L, d)`` and what maps its arrays' gradients
        back to parameters."""
        if self.variant == "alibi":
            return mods.alibi(self.p["slopes"]), lambda g: {"slopes": g[0]}
        if self.variant == "t5":
            return (mods.relative_bias(self.p["table"], 32, 128, bidirectional=False),
                    lambda g: {"table": g[0]})
        if self.variant == "forgetting":
            z = x @ self.p["Wf"] + self.p["bf"]                # (n, L, H)
            log_f = -np.logaddexp(0.0, z)                      # -softplus
            gate = np.moveaxis(log_f, -1, 1)                   # (n, H, L)

            def to_params(g):
                dz = -np.moveaxis(g[0], 1, -1) / (1.0 + np.exp(-z))  # d softplus = sigmoid
                return {"Wf": np.einsum("nld,nlh->dh", x, dz), "bf": dz.sum(axis=(0, 1))}
            return mods.forgetting(gate), to_params
        return None, None

    def forward(self, x, with_grad=False):
        n, L, _ = x.shape
        heads = lambda a: a.reshape(n, L, H, DH).transpose(0, 2, 1, 3)  # noqa: E731
        q, k, v = (heads(x @ self.p[w]) for w in ("Wq", "Wk", "Wv"))
        score, to_params = self.score_mod(x)
        kw = dict(mask_mod=strictly_before, score_mod=score, backend="cpu")
        if not with_grad:
            o = attnnb.attention(q, k, v, **kw)
            return o.transpose(0, 2, 1, 3).reshape(n, L, H * DH) @ self.p["Wo"]
        o, pullback = attnnb.vjp(attnnb.attention, q, k, v, **kw)
        flat = o.transpose(0, 2, 1, 3).reshape(n, L, H * DH)
        return flat @ self.p["Wo"], (x, flat, pullback, to_params)

    def gradients(self, saved, dy):
        x, flat, pullback, to_params = saved
        n, L, _ = x.shape
        grads = {"Wo": np.einsum("nlc,nlv->cv", flat, dy)}
        do = (dy @ self.p["Wo"].T).reshape(n, L, H, DH).transpose(0, 2, 1, 3)
        g = pullback(do)
        for name, w in (("q", "Wq"), ("k", "Wk"), ("v", "Wv")):
            grads[w] = np.einsum("nld,nlc->dc", x, g[name].transpose(0, 2, 1, 3).reshape(
                n, L, H * DH))
        if to_params is not None:
            grads.update(to_params(g["score_mod"]))
        return grads


def loss_of(layer, x, target, with_grad=False):
    y, saved = layer.forward(x, with_grad=True) if with_grad else (layer.forward(x), None)
    err = (y - np.roll(target, 1, axis=1))[:, 1:]  # position 0 has nothing before it
    loss = float(np.mean(err ** 2))
    if not with_grad:
        return loss, None
    dy = np.zeros_like(y)
    dy[:, 1:] = 2.0 * err / err.size
    return loss, layer.gradients(saved, dy)


def train(variant, steps, seed):
    rng = np.random.default_rng(seed)
    layer = Layer(variant, rng)
    adam = {k: (np.zeros_like(v), np.zeros_like(v)) for k, v in layer.p.items()}
    curve = []
    for step in range(1, steps + 1):
        x, values = batch(rng, 16, TRAIN_LEN)
        loss, grads = loss_of(layer, x, values, with_grad=True)
        curve.append(loss)
        for name, g in grads.items():
            m, v = adam[name]
            m[:] = 0.9 * m + 0.1 * g
            v[:] = 0.999 * v + 0.001 * g * g
            layer.p[name] -= 3e-3 * (m / (1 - 0.9 ** step)) / (np.sqrt(v / (1 - 0.999 ** step))
                                                              + 1e-8)
    evals = {}
    for length in EVAL_LENS:
        x, values = batch(np.random.default_rng(seed + 1000), 4, length)
        evals[length] = loss_of(layer, x, values)[0]
    return curve, evals


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    variants = ("none", "alibi", "t5", "forgetting")
    results = {v: train(v, args.steps, args.seed) for v in variants}
    print("mean squared error of the previous token's value (chance: 1.0)")
    print(f"{'variant':<12}" + "".join(f"{'L=' + str(n):>10}" for n in EVAL_LENS))
    for v, (_, evals) in results.items():
        print(f"{v:<12}" + "".join(f"{evals[n]:10.4f}" for n in EVAL_LENS))
    if args.no_plot:
        return results
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for v, (curve, evals) in results.items():
        left.plot(np.convolve(curve, np.ones(10) / 10, mode="valid"), label=v)
        right.plot(EVAL_LENS, [evals[n] for n in EVAL_LENS], marker="o", label=v)
    left.set(xlabel="step", ylabel="training loss (length 64)", yscale="log")
    right.set(xlabel="evaluation length", ylabel="loss", xscale="log", yscale="log")
    right.set_xticks(EVAL_LENS, [str(n) for n in EVAL_LENS])
    left.legend()
    fig.suptitle("one attention layer, trained at length 64: which score function extrapolates")
    fig.tight_layout()
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    os.makedirs(out, exist_ok=True)
    fig.savefig(os.path.join(out, "variants.png"), dpi=110)
    return results


if __name__ == "__main__":
    main()

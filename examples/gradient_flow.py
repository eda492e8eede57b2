"""Gradient flow through ten attention variants, trained on a planted-key retrieval task.

The task (a learnable cousin of ``examples/diff_noise.py``): every sequence
holds ``LK`` key tokens and ``LQ`` query tokens.  Key token ``j`` carries a
random unit code, a "topic" component of random strength ``a_j`` along the
sequence's topic direction, and a random value vector.  Query token ``i``
carries a noisy copy of the code of one key (its planted key), the topic at
full strength, and no value.  The target of query ``i`` is the value of its
planted key, so the model has to learn to match codes, to ignore the topic
(which draws attention to the distractors with a large ``a_j``: the noise)
and to read the value out.

The model is one attention layer with head dimension ``DH``: ``q = x Wq``,
``k = x Wk``, ``v = x Wv``, the prediction ``attention(q, k, v) @ Wo``,
trained with a mean squared error by Adam (no ``subln``, no residual:
``Wo`` absorbs the ``1 - lambda`` scale of differential attention's
output).  The forward pass runs through attnnb under :func:`attnnb.vjp`,
the backward pass through its pullback, and the gradients of the
projections (and of the re-parameterised ``lambda``) follow in a few lines
of NumPy.  The ten variants:

* ``softmax``, ``softmax1``, ``relu_expm1``, ``softpick`` (``relu_expm1``'s
  numerator over ``sum |e^s - 1|``), ``sigmoid`` (``sigmoid(s - log 64)``, no
  normalisation): :func:`attnnb.attention` with that ``normalizer=``
  (``backend="cpu"``);
* ``sinks``: softmax with a learned sink logit in the denominator
  (gpt-oss's; it starts at 0, i.e. ``softmax1``, and learns through
  :func:`attnnb.vjp`'s ``sinks`` gradient);
* ``diff``: :func:`attnnb.diff_attention`, two maps per head, with
  ``lambda = exp(lq1.lk1) - exp(lq2.lk2) + lambda_init`` learned through
  :func:`attnnb.diff.reparam_lambda` (``backend="cpu"``);
* ``rectified``: the same with ``mode="rectified"``, weights
  ``max(0, A1 - lambda A2)`` (``backend="cpu"``);
* ``heaviside``: ``mode="heaviside"``, weights ``A1 - lambda H(A1 - lambda
  A2)``, the discussion's second proposal: the second map only gates where
  ``lambda`` is subtracted, and gets no gradient;
* ``diff-uniform``: the ``diff`` layer with the second query and key
  components held at zero, so ``A2`` is uniform attention (``lambda``
  still learns): does a learned second map matter?

What to look for: besides the loss and the retrieval accuracy (the
prediction's nearest value among the sequence's ``LK`` values is the
planted key's), the share of logits whose gradient is exactly zero.  It is
read off the gradient of a zero ``bias`` of shape ``(B, 1, LQ, LK)``, which
is the gradient of the logits (for differential attention, the sum over
both maps' logits).  Softmax and ``softmax1`` pass a gradient to every
logit; ``relu_expm1`` passes none below 0 (``max(0, exp(s) - 1)`` is flat
there, and a row with no positive logit passes nothing at all); a planted
key whose logit starts below 0 is not pulled up by its own gradient, only
through the projections it shares with the other logits.  The
rectified mode's clip at 0 cuts only the direct path: a logit of a clipped
weight still gets gradient through its map's softmax denominator, so exact
zeros appear only in rows that were clipped entirely ("dead rows").
Everything runs in float64, so an exact zero is a flat part of the map, not
an underflow.

Saves ``examples/out/gradient_flow.png`` (loss curves; zero-gradient share
over training) and prints a summary table.  Runs in about 20 s on two cores
with the kernels cached, about 75 s on an empty kernel cache (compiling the
float64 cpu kernels of ``attention``, ``diff_attention`` and their backward
passes; they are cached on disk for later runs).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import attnnb
from attnnb.diff import lambda_init, reparam_lambda

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")

# ------------------------------------------------------------------ the task
LK, LQ = 64, 4  # keys (one planted per query, the rest distractors) and queries per sequence
DC, DT, DV = 16, 4, 8  # widths of the code, topic and value parts of a token
DIN = DC + DT + DV
DH = 16  # head dimension of each map
TOPIC = 4.0  # scale of the distractors' topic strength a_j
QUERY_NOISE = 0.5  # noise on the query's copy of its planted key's code

# name, function, keyword arguments of the attention call, second map
VARIANTS = (
    ("softmax", "attention", {"normalizer": "softmax", "backend": "cpu"}, None),
    ("softmax1", "attention", {"normalizer": "softmax1", "backend": "cpu"}, None),
    ("relu_expm1", "attention", {"normalizer": "relu_expm1", "backend": "cpu"}, None),
    ("softpick", "attention", {"normalizer": "softpick", "backend": "cpu"}, None),
    ("sigmoid", "attention", {"normalizer": "sigmoid", "backend": "cpu"}, None),
    ("sinks", "attention", {"normalizer": "softmax", "backend": "cpu"}, "sink"),
    ("diff", "diff", {"mode": "difference", "backend": "cpu"}, "learned"),
    ("rectified", "diff", {"mode": "rectified", "backend": "cpu"}, "learned"),
    ("heaviside", "diff", {"mode": "heaviside", "backend": "cpu"}, "learned"),
    ("diff-uniform", "diff", {"mode": "difference", "backend": "cpu"}, "uniform"),
)


def make_batch(rng, batch):
    """Draw ``batch`` sequences of the planted-key task.

    Parameters
    ----------
    rng : numpy.random.Generator
    batch : int
        Number of sequences.

    Returns
    -------
    xq : ndarray ``(batch, LQ, DIN)``
        Query tokens: ``[noisy code of the planted key | topic | 0]``.
    xk : ndarray ``(batch, LK, DIN)``
        Key tokens: ``[code | a_j * topic | value]``.
    values : ndarray ``(batch, LK, DV)``
        The value part of every key token.
    planted : ndarray of int ``(batch, LQ)``
        The index of each query's planted key.
    """
    codes = rng.standard_normal((batch, LK, DC))
    codes /= np.linalg.norm(codes, axis=-1, keepdims=True)
    topic = rng.standard_normal((batch, 1, DT))
    topic /= np.linalg.norm(topic, axis=-1, keepdims=True)
    strength = TOPIC * rng.standard_normal((batch, LK, 1))
    values = rng.standard_normal((batch, LK, DV))
    planted = np.argsort(rng.random((batch, LK)), axis=1)[:, :LQ]  # distinct keys per sequence
    xk = np.concatenate([codes, strength * topic, values], axis=-1)
    target_codes = np.take_along_axis(codes, planted[..., None], axis=1)
    noisy = target_codes + QUERY_NOISE * rng.standard_normal((batch, LQ, DC)) / np.sqrt(DC)
    xq = np.concatenate([noisy, np.broadcast_to(topic, (batch, LQ, DT)),
                         np.zeros((batch, LQ, DV))], axis=-1)
    return xq, xk, values, planted


# ------------------------------------------------------------------ the model
def init_params(rng, kind, second_map):
    """Initial parameters of one variant.

    Parameters
    ----------
    rng : numpy.random.Generator
    kind : {"attention", "diff"}
        One map per head, or a differential pair of maps.
    second_map : {None, "sink", "learned", "uniform"}
        ``"sink"``: one map with a learned sink logit (``sink``, starting at
        0: ``softmax1``); for ``"uniform"`` the second query and key
        projections are zero (and stay so): ``A2`` is uniform attention.

    Returns
    -------
    dict of str to ndarray
        ``Wq, Wk (DIN, maps, DH)``, ``Wv (DIN, DV)``, ``Wo (DV, DV)`` and, for
        differential attention, the lambda vectors ``lq1, lk1, lq2, lk2 (DH,)``;
        ``sink (1,)`` with a learned sink.
    """
    maps = 1 if kind == "attention" else 2
    p = {
        "Wq": rng.standard_normal((DIN, maps, DH)) / np.sqrt(DIN),
        "Wk": rng.standard_normal((DIN, maps, DH)) / np.sqrt(DIN),
        "Wv": rng.standard_normal((DIN, DV)) / np.sqrt(DIN),
        "Wo": rng.standard_normal((DV, DV)) / np.sqrt(DV),
    }
    if kind == "diff":
        for name in ("lq1", "lk1", "lq2", "lk2"):
            p[name] = 0.1 * rng.standard_normal(DH)
    if second_map == "sink":
        p["sink"] = np.zeros(1)
    if second_map == "uniform":
        p["Wq"][:, 1] = 0.0
        p["Wk"][:, 1] = 0.0
    return p


LAMBDA_INIT = lambda_init(1)  # 0.8 - 0.6 exp(-0.3): the second layer's lambda_init


def loss_and_grads(p, batch, kind, call_kwargs):
    """Forward through attnnb, backward through its pullback and the projections.

    Parameters
    ----------
    p : dict of str to ndarray
        The parameters (:func:`init_params`).
    batch : tuple
        ``(xq, xk, values, planted)`` of :func:`make_batch`.
    kind : {"attention", "diff"}
    call_kwargs : dict
        Keyword arguments of the attention call (normalizer or mode, backend).

    Returns
    -------
    loss : float
        Mean squared error of the prediction against the planted value.
    grads : dict of str to ndarray
        The gradient of ``loss`` for every entry of ``p``.
    stats : dict
        ``accuracy`` (share of queries whose prediction is nearest to the
        planted key's value), ``zero_share`` (share of logits whose gradient
        is exactly zero), ``planted_zero`` (share of queries whose planted
        key's logit gets none), ``dead_rows`` (share of queries with no logit
        gradient at all) and ``lam`` (differential attention's lambda, or NaN).
    """
    xq, xk, values, planted = batch
    B = xq.shape[0]
    q = np.einsum("bli,ime->bmle", xq, p["Wq"])  # (B, maps, LQ, DH)
    k = np.einsum("bli,ime->bmle", xk, p["Wk"])  # (B, maps, LK, DH)
    v = (xk @ p["Wv"])[:, None]  # (B, 1, LK, DV)
    bias = np.zeros((B, 1, LQ, LK))  # its gradient is the logits' gradient
    if kind == "attention":
        sinks = {"sinks": p["sink"]} if "sink" in p else {}
        out, pullback = attnnb.vjp(attnnb.attention, q, k, v, bias=bias, **sinks,
                                   **call_kwargs)
        lam = np.nan
    else:
        lam = reparam_lambda(p["lq1"], p["lk1"], p["lq2"], p["lk2"], LAMBDA_INIT)
        out, pullback = attnnb.vjp(attnnb.diff_attention, q, k, v, lam, bias=bias,
                                   **call_kwargs)
    o = out[:, 0]  # (B, LQ, DV)
    pred = o @ p["Wo"]
    target = np.take_along_axis(values, planted[..., None], axis=1)
    err = pred - target
    loss = float(np.mean(err**2))

    dpred = 2.0 * err / err.size
    g = pullback((dpred @ p["Wo"].T)[:, None])
    grads = {
        "Wo": np.einsum("bld,ble->de", o, dpred),
        "Wq": np.einsum("bli,bmle->ime", xq, g["q"]),
        "Wk": np.einsum("bli,bmle->ime", xk, g["k"]),
        "Wv": np.einsum("bli,ble->ie", xk, g["v"][:, 0]),
    }
    if "sink" in p:
        grads["sink"] = g["sinks"]
    if kind == "diff":  # lambda = exp(lq1.lk1) - exp(lq2.lk2) + lambda_init
        dlam = float(g["lam"])
        e1 = np.exp(p["lq1"] @ p["lk1"])
        e2 = np.exp(p["lq2"] @ p["lk2"])
        grads["lq1"], grads["lk1"] = dlam * e1 * p["lk1"], dlam * e1 * p["lq1"]
        grads["lq2"], grads["lk2"] = -dlam * e2 * p["lk2"], -dlam * e2 * p["lq2"]

    zero = g["bias"][:, 0] == 0.0  # (B, LQ, LK); every key is allowed
    planted_zero = np.take_along_axis(zero, planted[..., None], axis=-1)
    dist = np.linalg.norm(pred[:, :, None, :] - values[:, None, :, :], axis=-1)
    stats = {
        "accuracy": float(np.mean(dist.argmin(axis=-1) == planted)),
        "zero_share": float(zero.mean()),
        "dead_rows": float(zero.all(axis=-1).mean()),
        "planted_zero": float(planted_zero.mean()),
        "lam": float(lam),
    }
    return loss, grads, stats


def train(name, kind, call_kwargs, second_map, steps, batch, lr, seed):
    """Train one variant with Adam on fresh batches; evaluate on a held-out set.

    Parameters
    ----------
    name : str
        The variant's label (for messages).
    kind, call_kwargs, second_map
        As in :data:`VARIANTS`.
    steps, batch : int
        Adam steps and sequences per step.
    lr : float
        Adam's step size.
    seed : int
        Seeds the initial parameters and the batches; the same for every
        variant, so that all see the same data.

    Returns
    -------
    dict
        ``loss``, ``zero_share`` and ``planted_zero`` per step (arrays), ``eval`` (the stats of
        :func:`loss_and_grads` on 1024 held-out sequences, plus their
        ``loss``) and ``seconds``.
    """
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    p = init_params(rng, kind, second_map)
    frozen = {"Wq": 1, "Wk": 1} if second_map == "uniform" else {}  # map index held at zero
    m = {n: np.zeros_like(a) for n, a in p.items()}
    s = {n: np.zeros_like(a) for n, a in p.items()}
    b1, b2, eps = 0.9, 0.999, 1e-8
    losses, zeros, planted_zeros = np.empty(steps), np.empty(steps), np.empty(steps)
    for t in range(1, steps + 1):
        loss, grads, stats = loss_and_grads(p, make_batch(rng, batch), kind, call_kwargs)
        losses[t - 1], zeros[t - 1] = loss, stats["zero_share"]
        planted_zeros[t - 1] = stats["planted_zero"]
        for n, gr in grads.items():
            if n in frozen:
                gr[:, frozen[n]] = 0.0
            m[n] = b1 * m[n] + (1 - b1) * gr
            s[n] = b2 * s[n] + (1 - b2) * gr * gr
            p[n] -= lr * (m[n] / (1 - b1**t)) / (np.sqrt(s[n] / (1 - b2**t)) + eps)
    held_out = make_batch(np.random.default_rng(seed + 1), 1024)
    loss, _, stats = loss_and_grads(p, held_out, kind, call_kwargs)
    stats["loss"] = loss
    return {"loss": losses, "zero_share": zeros, "planted_zero": planted_zeros, "eval": stats,
            "seconds": time.perf_counter() - t0}


# ------------------------------------------------------------------ report
def smooth(x, width):
    """Running mean over ``width`` steps (shorter at the start)."""
    c = np.cumsum(np.r_[0.0, x])
    n = np.arange(1, len(x) + 1)
    lo = np.maximum(n - width, 0)
    return (c[n] - c[lo]) / (n - lo)


def plot(results, path, steps):
    """Save the two panels: loss curves, and the zero-gradient share over training.

    Parameters
    ----------
    results : dict of str to dict
        :func:`train`'s result per variant.
    path : str
        Where to save the PNG.
    steps : int
        Number of training steps (for the x axis).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_zero) = plt.subplots(1, 2, figsize=(13, 5), layout="constrained")
    x = np.arange(1, steps + 1)
    for i, (name, r) in enumerate(results.items()):
        ls = {"diff-uniform": "--", "softmax1": ":"}.get(name, "-")  # softmax1 ~ softmax
        style = {"color": f"C{i}", "lw": 1.4, "ls": ls}
        ev = r["eval"]
        ax_loss.plot(x, smooth(r["loss"], 10), label=f"{name} (held-out accuracy "
                     f"{100 * ev['accuracy']:.0f} %)", **style)
        ax_zero.plot(x, 100 * smooth(r["zero_share"], 10), label=f"{name}: all logits", **style)
        if r["planted_zero"].any() and not np.array_equal(r["planted_zero"], r["zero_share"]):
            ax_zero.plot(x, 100 * smooth(r["planted_zero"], 10), color=f"C{i}", lw=1.0,
                         ls="-.", label=f"{name}: the planted key's logit")
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("Adam step")
    ax_loss.set_ylabel("training loss (MSE, running mean of 10 steps)")
    ax_loss.set_title("Loss")
    ax_loss.legend(fontsize=9)
    ax_zero.set_xlabel("Adam step")
    ax_zero.set_ylabel("% with gradient exactly 0 (running mean of 10 steps)")
    ax_zero.set_title("Share of logits that receive no gradient (training batches)")
    ax_zero.set_yscale("symlog", linthresh=0.1, linscale=0.5)
    ax_zero.set_ylim(-0.02, 100)
    ax_zero.set_yticks([0, 0.1, 1, 10, 100], ["0", "0.1", "1", "10", "100"])
    ax_zero.legend(fontsize=9, loc="center left")
    flat = [n for n, r in results.items() if not r["zero_share"].any()]
    if flat:
        ax_zero.text(0.02, 0.06, f"0 at every step: {', '.join(flat)}", fontsize=9,
                     transform=ax_zero.transAxes)
    fig.suptitle(f"One attention layer learning to retrieve a planted key among {LK - 1} "
                 f"distractors ({LQ} queries per sequence)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="Adam steps per variant")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step")
    parser.add_argument("--lr", type=float, default=0.01, help="Adam step size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(OUT_DIR, "gradient_flow.png"))
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    results = {}
    for name, kind, call_kwargs, second_map in VARIANTS:
        results[name] = r = train(name, kind, call_kwargs, second_map, args.steps, args.batch,
                                  args.lr, args.seed)
        print(f"trained {name:<13} {r['seconds']:5.1f} s ({call_kwargs['backend']})")

    print(f"\n{'variant':<13} {'loss':>8} {'accuracy':>9} {'zero grad':>10} "
          f"{'(training)':>11} {'planted 0':>10} {'(training)':>11} {'dead rows':>10} "
          f"{'lambda':>7}")
    for name, r in results.items():
        ev = r["eval"]
        lam = "" if np.isnan(ev["lam"]) else f"{ev['lam']:.3f}"
        print(f"{name:<13} {ev['loss']:8.4f} {100 * ev['accuracy']:8.1f}% "
              f"{100 * ev['zero_share']:9.2f}% {100 * r['zero_share'].mean():10.2f}% "
              f"{100 * ev['planted_zero']:9.1f}% {100 * r['planted_zero'].mean():10.1f}% "
              f"{100 * ev['dead_rows']:9.2f}% {lam:>7}")
    print("zero grad: share of logits whose gradient is exactly 0; planted 0: share of queries "
          "whose planted key's logit\ngets none; dead rows: queries with no logit gradient at "
          "all.  Columns on 1024 held-out sequences after\ntraining, except (training): the "
          "mean over all steps of the column to its left.")
    plot(results, args.out, args.steps)
    print(f"\nsaved {args.out} ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()

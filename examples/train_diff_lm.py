"""Train a small Diff Transformer language model in PyTorch, attention through attnnb.

A character-level language model (2 layers, width 128, 4 differential heads
of two 16-wide components each, values 32 wide, context 128) learns to
continue Python source code: the text of a few modules of Python's own
standard library, read from this interpreter's installation, so nothing is
downloaded.  Each layer's attention is differential attention (Ye et al.,
*Differential Transformer*, ICLR 2025) with the learned, re-parameterised
``lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init`` and the per-head
RMS normalisation ("subln") scaled by ``1 - lambda_init``, as in
microsoft/unilm's ``multihead_flashdiff_1.py``.

The same model (same initial weights, same batches) is trained twice:

* ``attnnb``: ``attnnb.torch.diff_attention(q, k, v, lam, causal=True)``,
  one custom operator forward and one backward;
* ``sdpa``: the reference implementation's route, two calls of
  ``torch.nn.functional.scaled_dot_product_attention`` (one per map) and
  ``o1 - lam * o2``.

Both give the same mathematics, so their loss curves must lie on top of
each other (the float32 rounding of the two routes differs, and Adam
amplifies that a little over the steps); the script prints the step times
and the largest difference of the two curves, and saves them to
``examples/out/train_diff_lm.png``.

Run: ``python examples/train_diff_lm.py [--steps 300]`` (``pip install
torch matplotlib``; about two minutes on two cores).
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sysconfig
import time

# Torch's OpenMP threads keep spinning after each operator and take the cores
# from the next attnnb call (docs/notes/performance.md, "Inside a PyTorch program").
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attnnb.torch as at  # noqa: E402
from attnnb import diff  # noqa: E402

CONTEXT, WIDTH, HEADS, LAYERS, BATCH = 128, 128, 4, 2, 16
HEAD = WIDTH // HEADS // 2  # one component of a differential head (16)
MODULES = ("argparse.py", "inspect.py", "dataclasses.py", "typing.py", "textwrap.py")
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def corpus() -> tuple[np.ndarray, int]:
    """Bytes of a few standard-library modules as token ids (0-255)."""
    lib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    text = b"".join((lib / name).read_bytes() for name in MODULES if (lib / name).exists())
    return np.frombuffer(text, dtype=np.uint8).astype(np.int64), 256


class DiffAttention(torch.nn.Module):
    """One differential attention layer; ``route`` picks attnnb or two SDPA calls."""

    def __init__(self, depth: int, route: str):
        super().__init__()
        self.route = route
        self.q = torch.nn.Linear(WIDTH, WIDTH, bias=False)   # 2H components of width HEAD
        self.k = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.v = torch.nn.Linear(WIDTH, WIDTH, bias=False)   # H values of width 2 HEAD
        self.out = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.lambda_init = float(diff.lambda_init(depth))
        self.lam = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(HEAD) * 0.1) for _ in range(4)])
        self.norm = torch.nn.RMSNorm(2 * HEAD, eps=1e-5, elementwise_affine=False)

    def forward(self, x):
        B, L, _ = x.shape
        q = self.q(x).view(B, L, 2 * HEADS, HEAD).transpose(1, 2)
        k = self.k(x).view(B, L, 2 * HEADS, HEAD).transpose(1, 2)
        v = self.v(x).view(B, L, HEADS, 2 * HEAD).transpose(1, 2)
        lq1, lk1, lq2, lk2 = self.lam
        lam = torch.exp((lq1 * lk1).sum()) - torch.exp((lq2 * lk2).sum()) + self.lambda_init
        if self.route == "attnnb":
            o = at.diff_attention(q, k, v, lam, causal=True)
        else:  # query heads 2h, 2h+1 are the two maps of pair h, as attnnb pairs them
            q2, k2 = q.view(B, HEADS, 2, L, HEAD), k.view(B, HEADS, 2, L, HEAD)
            o1 = F.scaled_dot_product_attention(q2[:, :, 0], k2[:, :, 0], v, is_causal=True)
            o2 = F.scaled_dot_product_attention(q2[:, :, 1], k2[:, :, 1], v, is_causal=True)
            o = o1 - lam * o2
        o = self.norm(o) * (1.0 - self.lambda_init)
        return self.out(o.transpose(1, 2).reshape(B, L, WIDTH)), lam


class Model(torch.nn.Module):
    def __init__(self, vocab: int, route: str):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, WIDTH)
        self.pos = torch.nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.02)
        self.blocks = torch.nn.ModuleList()
        for depth in range(LAYERS):
            self.blocks.append(torch.nn.ModuleDict({
                "norm1": torch.nn.LayerNorm(WIDTH), "attn": DiffAttention(depth, route),
                "norm2": torch.nn.LayerNorm(WIDTH),
                "mlp": torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                           torch.nn.Linear(4 * WIDTH, WIDTH))}))
        self.head = torch.nn.Linear(WIDTH, vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        lams = []
        for b in self.blocks:
            a, lam = b["attn"](b["norm1"](x))
            x = x + a
            x = x + b["mlp"](b["norm2"](x))
            lams.append(float(lam.detach()))
        return self.head(x), lams


def train(route: str, data: np.ndarray, vocab: int, steps: int, seed: int = 0):
    torch.manual_seed(seed)
    model = Model(vocab, route)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    batches = np.random.default_rng(seed)
    losses, times, lams = [], [], []
    for step in range(steps):
        starts = batches.integers(0, len(data) - CONTEXT - 1, BATCH)
        chunk = torch.from_numpy(np.stack([data[s:s + CONTEXT + 1] for s in starts]))
        t0 = time.perf_counter()
        logits, lam = model(chunk[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), chunk[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        lams.append(lam)
        if step % 50 == 0 or step == steps - 1:
            print(f"  {route:6s} step {step:4d}  loss {losses[-1]:.3f}  lambda "
                  + " ".join(f"{x:.3f}" for x in lam))
    return np.array(losses), np.array(times), np.array(lams)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    data, vocab = corpus()
    print(f"corpus: {len(data)} characters of Python source; {args.steps} steps of "
          f"{BATCH} x {CONTEXT} tokens")
    runs = {route: train(route, data, vocab, args.steps) for route in ("attnnb", "sdpa")}
    print(f"\n{'route':8s} {'median step':>12s} {'final loss':>11s} {'lambda (last)':>14s}")
    for route, (loss, times, lams) in runs.items():
        print(f"{route:8s} {1e3 * np.median(times[5:]):10.1f} ms {loss[-10:].mean():11.3f} "
              f"{' '.join(f'{x:.3f}' for x in lams[-1]):>14s}")
    gap = np.abs(runs["attnnb"][0] - runs["sdpa"][0])
    print(f"largest loss difference between the routes: {gap.max():.2e} "
          f"(first 50 steps: {gap[:50].max():.2e}); bits/char at the end "
          f"{runs['attnnb'][0][-10:].mean() / math.log(2):.2f}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no picture")
        return
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for route, (loss, _, lams) in runs.items():
        ax.plot(loss, label=route, lw=1.2 if route == "attnnb" else 0.8,
                ls="-" if route == "attnnb" else "--")
        bx.plot(lams, lw=1, ls="-" if route == "attnnb" else "--")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/char)",
           title="Diff Transformer LM: attnnb vs two SDPA calls")
    ax.legend()
    bx.set(xlabel="step", ylabel="learned lambda (per layer)", title="lambda during training")
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "train_diff_lm.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"saved {path}")


if __name__ == "__main__":
    main()

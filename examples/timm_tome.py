"""Token Merging in a timm Vision Transformer, attention through attnnb.

A timm ``vit_small_patch16_224`` (12 blocks, width 384, 6 heads of 64, 197
tokens; random weights, ``pretrained=False``: nothing is downloaded) has
every block's forward replaced by a ToMe block (facebookresearch/ToMe's
``ToMeBlock`` / ``ToMeAttention`` order):

1. attention with proportional attention, through
   ``attnnb.torch.attention(q, k, v, key_size=size)`` (a merged token of
   size ``s`` counts as ``s`` keys);
2. ``r`` tokens merged by ``attnnb.tome.bipartite_soft_matching`` on the
   keys averaged over heads, then ``attnnb.tome.merge_wavg`` (the class
   token is never merged);
3. the MLP on the fewer tokens.

At ``r = 0`` the patched model must give the unpatched model's output (it
only swaps PyTorch's attention for attnnb's); the script checks that, then
prints a table of throughput (images per second, batch 32) and of the
change of the output logits for several ``r``, against the behaviour that
the ToMe paper reports for ViT-S (more merging: higher throughput, small
change of the output; ``r = 13`` about doubles DeiT-S throughput at a
0.4 point accuracy drop).  With random weights "accuracy" is meaningless,
so the change is reported as the relative error of the logits and the share
of images whose top-1 class is unchanged.  Saves the table as a bar chart
to ``examples/out/timm_tome.png``.

Run: ``python examples/timm_tome.py`` (``pip install torch timm``; about
a minute on two cores).
"""

from __future__ import annotations

import argparse
import os
import time

# Torch's OpenMP threads keep spinning after each operator and take the cores
# from the next attnnb call (docs/notes/performance.md, "Inside a PyTorch program").
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import timm  # noqa: E402
import torch  # noqa: E402

import attnnb.torch as at  # noqa: E402
from attnnb import tome  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def tome_block(block, state: dict):
    """A replacement for ``block.forward`` (a timm ``Block``) with Token Merging."""
    attn = block.attn

    def forward(x, attn_mask=None, is_causal=False):
        B, N, C = x.shape
        h = block.norm1(x)
        qkv = attn.qkv(h).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = attn.q_norm(q), attn.k_norm(k)
        size = state["size"]
        o = at.attention(q, k, v, key_size=size)                    # proportional attention
        o = attn.proj(attn.norm(o.transpose(1, 2).reshape(B, N, C)))
        x = x + block.drop_path1(block.ls1(o))
        r = state["r"].pop(0)
        if r > 0:  # ToMe merges after attention, on the keys averaged over heads
            m = tome.bipartite_soft_matching(k.mean(1).numpy(), r, class_token=True)
            merged, size = tome.merge_wavg(m, x.numpy(), None if size is None else size.numpy())
            x, state["size"] = torch.from_numpy(merged), torch.from_numpy(size)
        return x + block.drop_path2(block.ls2(block.mlp(block.norm2(x))))
    return forward


class ToMe:
    """Patch a timm ViT in place; ``model.r`` style: set ``patch.r`` before each call."""

    def __init__(self, model):
        self.model, self.r = model, 0
        self.state = {"r": [], "size": None}
        self.blocks = list(model.blocks)
        self.saved = [b.forward for b in self.blocks]
        for b in self.blocks:
            b.forward = tome_block(b, self.state)

    def __call__(self, images):
        self.state["r"] = list(tome.parse_r(len(self.blocks), self.r))
        self.state["size"] = None
        return self.model(images)

    def remove(self):
        for b, f in zip(self.blocks, self.saved):
            b.forward = f


def images(batch: int, seed: int = 0) -> torch.Tensor:
    """Natural-image statistics without a download: matplotlib's photograph, shifted copies."""
    try:
        from matplotlib import cbook
        with cbook.get_sample_data("grace_hopper.jpg") as f:
            import matplotlib.image as mpimg
            photo = mpimg.imread(f).astype(np.float32) / 255.0     # (600, 512, 3)
    except Exception:  # no matplotlib: smooth random fields
        photo = np.random.default_rng(seed).random((600, 512, 3), dtype=np.float32)
    rng = np.random.default_rng(seed)
    crops = []
    for _ in range(batch):
        y, x = rng.integers(0, photo.shape[0] - 224), rng.integers(0, photo.shape[1] - 224)
        crop = photo[y:y + 224, x:x + 224]
        crops.append(crop[:, ::-1] if rng.random() < 0.5 else crop)
    arr = (np.stack(crops) - 0.5) / 0.25
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(0, 3, 1, 2)))


def throughput(fn, x, repeats: int) -> float:
    fn(x)  # compile / warm
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - t)
    return x.shape[0] / best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--r", type=int, nargs="*", default=[0, 4, 8, 13, 16])
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", pretrained=False).eval()
    x = images(args.batch)
    with torch.inference_mode():
        baseline = model(x)
        base_rate = throughput(model, x, args.repeats)
        patch = ToMe(model)
        patch.r = 0
        same = patch(x)
        err0 = float((same - baseline).abs().max() / baseline.abs().max())
        print(f"r = 0 against the unpatched model: max relative difference {err0:.1e}")
        assert err0 < 1e-4, "the patched model at r = 0 must be the unpatched model"
        rows = []
        for r in args.r:
            patch.r = r
            out = patch(x)
            rate = throughput(patch, x, args.repeats)
            rel = float((out - baseline).norm() / baseline.norm())
            agree = float((out.argmax(1) == baseline.argmax(1)).float().mean())
            size = patch.state["size"]  # after the last block (r is clamped as tokens run out)
            tokens = 197 if size is None else size.shape[1]
            rows.append((r, tokens, rate, rate / base_rate, rel, agree))
        patch.remove()
    print(f"\ntimm vit_small_patch16_224, batch {args.batch}, float32, "
          f"{torch.get_num_threads()} threads; unpatched (PyTorch SDPA): {base_rate:.1f} img/s")
    print(f"{'r':>3s} {'tokens left':>11s} {'img/s':>8s} {'vs unpatched':>12s} "
          f"{'logit change':>12s} {'top-1 same':>10s}")
    for r, tokens, rate, speedup, rel, agree in rows:
        print(f"{r:3d} {tokens:11d} {rate:8.1f} {speedup:11.2f}x {rel:12.2e} {agree:10.0%}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    rs = [row[0] for row in rows]
    ax.bar([str(r) for r in rs], [row[3] for row in rows], color="tab:blue")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(xlabel="r (tokens merged per block)", ylabel="throughput vs unpatched",
           title="ToMe through attnnb in timm ViT-S/16")
    for i, row in enumerate(rows):
        ax.text(i, row[3], f"{row[4]:.0e}", ha="center", va="bottom", fontsize=8)
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "timm_tome.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"saved {path} (bar labels: relative change of the logits)")


if __name__ == "__main__":
    main()

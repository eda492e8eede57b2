"""Token Merging in a small ViT-style encoder, in NumPy with attnnb.

A 12-layer encoder (width 192, 3 heads, patch 16, 224 x 224 input, class
token: 197 tokens) with seeded random weights runs on matplotlib's bundled
Grace Hopper photograph (and flipped / shifted copies of it) with r = 0, 4,
8, 12, 16 tokens merged per layer.  For each r it prints the throughput and
the relative error of the final class token against the unmerged model, with
proportional attention (``attention(..., key_size=size)``) and without (every
merged token counted once), and saves a picture of the merge groups
(``merge_source``) to ``examples/out/tome_vit.png``.

Run: ``python examples/tome_vit.py`` (under a minute on two cores).
"""

from __future__ import annotations

import os
import time

# The encoder's matrix products are small (at most 788 x 768 rows x columns);
# on a 2-core machine OpenBLAS's own threads made them 3x slower and hid the
# effect of merging.  Set OPENBLAS_NUM_THREADS yourself to override.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402  (after the thread setting)

import attnnb  # noqa: E402
from attnnb import tome  # noqa: E402

WIDTH, HEADS, LAYERS, MLP, PATCH, SIDE = 192, 3, 12, 768, 16, 224
GRID = SIDE // PATCH
R_VALUES = (0, 4, 8, 12, 16)
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def load_images(batch: int) -> np.ndarray:
    """``(batch, 224, 224, 3)`` float32 in [0, 1]: the bundled photograph and variants."""
    import matplotlib.pyplot as plt
    from matplotlib import cbook

    with cbook.get_sample_data("grace_hopper.jpg") as f:
        img = plt.imread(f, format="jpg").astype(np.float32) / 255.0  # (600, 512, 3)
    img = img[44:556, :512]                                            # square crop
    idx = (np.arange(SIDE) * img.shape[0] / SIDE).astype(int)
    img = img[idx][:, idx]                                             # nearest-neighbour resize
    out = [img]
    for i in range(1, batch):
        v = np.roll(img, shift=(7 * i, -11 * i), axis=(0, 1))
        out.append(v[:, ::-1] if i % 2 else v)
    return np.stack(out)


def init_weights(seed: int = 0) -> dict:
    """Seeded random weights, scaled so that attention is neither uniform nor one-hot."""
    rng = np.random.default_rng(seed)

    def w(*shape, scale):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    layers = []
    for _ in range(LAYERS):
        layers.append({
            "qkv": w(WIDTH, 3 * WIDTH, scale=1.5 / np.sqrt(WIDTH)),
            "proj": w(WIDTH, WIDTH, scale=0.5 / np.sqrt(WIDTH)),
            "fc1": w(WIDTH, MLP, scale=1.0 / np.sqrt(WIDTH)),
            "fc2": w(MLP, WIDTH, scale=0.5 / np.sqrt(MLP)),
        })
    return {
        "embed": w(PATCH * PATCH * 3, WIDTH, scale=1.0 / np.sqrt(PATCH * PATCH * 3)),
        "cls": w(1, 1, WIDTH, scale=1.0),
        "pos": w(1, GRID * GRID + 1, WIDTH, scale=0.1),
        "layers": layers,
    }


def layer_norm(x):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(x.var(-1, keepdims=True) + 1e-6)


def dense(x, w):
    """``x @ w`` over the last axis as one 2-D product (NumPy's stacked matmul is slower)."""
    return (x.reshape(-1, x.shape[-1]) @ w).reshape(x.shape[:-1] + (w.shape[1],))


def gelu(x):
    return 0.5 * x * (1.0 + np.tanh(0.7978845608 * (x + 0.044715 * (x * x * x))))


def embed(images, weights):
    B = images.shape[0]
    patches = images.reshape(B, GRID, PATCH, GRID, PATCH, 3).transpose(0, 1, 3, 2, 4, 5)
    tokens = dense(patches.reshape(B, GRID * GRID, -1), weights["embed"])
    cls = np.broadcast_to(weights["cls"], (B, 1, WIDTH))
    return np.concatenate([cls, tokens], axis=1) + weights["pos"]


def encode(images, weights, r, *, proportional=True, track_source=False):
    """Class token output of the encoder; ToMe with ``r`` merges per layer.

    Block order (as ToMe's ``ToMeBlock``): attention with sizes -> merge
    with the layer's keys (averaged over heads) -> MLP.
    """
    x = embed(images, weights)
    B = x.shape[0]
    size = source = None
    for layer, r_layer in zip(weights["layers"], tome.parse_r(LAYERS, r), strict=True):
        N = x.shape[1]
        qkv = dense(layer_norm(x), layer["qkv"]).reshape(B, N, 3, HEADS, WIDTH // HEADS)
        q, k, v = qkv.transpose(2, 0, 3, 1, 4)                    # (B, H, N, d) each
        att = attnnb.attention(q, k, v, key_size=size if proportional else None)
        x = x + dense(att.transpose(0, 2, 1, 3).reshape(B, N, WIDTH), layer["proj"])
        m = tome.bipartite_soft_matching(k.mean(axis=1), r_layer, class_token=True)
        if track_source:
            source = tome.merge_source(m, x, source)
        x, size = tome.merge_wavg(m, x, size)
        x = x + dense(gelu(dense(layer_norm(x), layer["fc1"])), layer["fc2"])
    out = layer_norm(x)[:, 0]
    return (out, source) if track_source else out


def timed(images, weights, r, repeats=5):
    """``(images per second, best of repeats; class token outputs)`` with proportional attention."""
    best = np.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = encode(images, weights, r)
        best = min(best, time.perf_counter() - t0)
    return images.shape[0] / best, out


def group_picture(image, source):
    """Every patch painted with the mean colour of its merge group, edges darkened."""
    group = source[0, :, 1:].argmax(axis=0).reshape(GRID, GRID)   # patch -> merged token
    patches = image.reshape(GRID, PATCH, GRID, PATCH, 3).mean(axis=(1, 3))
    colours = np.zeros((group.max() + 1, 3))
    np.add.at(colours, group.ravel(), patches.reshape(-1, 3))
    colours /= np.maximum(np.bincount(group.ravel(), minlength=len(colours)), 1)[:, None]
    big = np.kron(group, np.ones((PATCH, PATCH), int))
    pic = colours[big]
    edge = np.zeros(big.shape, bool)
    edge[:, 1:] |= big[:, 1:] != big[:, :-1]
    edge[1:, :] |= big[1:, :] != big[:-1, :]
    pic[edge] *= 0.35
    return pic


def main():
    images = load_images(8)
    weights = init_weights()
    encode(images[:1], weights, 8)  # compile the kernels outside the timings
    base, reference = timed(images, weights, 0)
    scale = np.linalg.norm(reference, axis=-1)
    print(f"ViT-style encoder: {LAYERS} layers, width {WIDTH}, {HEADS} heads, "
          f"{GRID * GRID + 1} tokens, batch {images.shape[0]}, float32, attnnb cpu backend")
    print("error: mean over images of |cls(r) - cls(0)| / |cls(0)| (final class token)")
    print(f"{'r':>3} {'tokens out':>10} {'img/s':>8} {'speed-up':>8} "
          f"{'error (proportional)':>21} {'error (plain)':>14}")
    for r in R_VALUES:
        tokens = GRID * GRID + 1 - sum(max(0, min(v, (n - 1) // 2)) for v, n in
                                       _token_counts(r))
        ips, prop = (base, reference) if r == 0 else timed(images, weights, r)
        plain = encode(images, weights, r, proportional=False)
        errs = [np.mean(np.linalg.norm(out - reference, axis=-1) / scale)
                for out in (prop, plain)]
        print(f"{r:>3} {tokens:>10} {ips:>8.1f} {ips / base:>7.2f}x "
              f"{errs[0]:>21.4f} {errs[1]:>14.4f}")

    os.makedirs(OUT_DIR, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = (4, 8, 16)
    fig, axes = plt.subplots(1, len(shown) + 1, figsize=(4 * (len(shown) + 1), 4.3))
    axes[0].imshow(images[0])
    axes[0].set_title("input (224 x 224, 196 patches)")
    for ax, r in zip(axes[1:], shown, strict=True):
        _, source = encode(images[:1], weights, r, track_source=True)
        ax.imshow(group_picture(images[0], source))
        ax.set_title(f"r = {r}: {source.shape[1] - 1} groups")
    for ax in axes:
        ax.axis("off")
    fig.suptitle("ToMe merge groups after 12 layers (random weights): merge_source")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    path = os.path.join(OUT_DIR, "tome_vit.png")
    fig.savefig(path, dpi=80)
    print(f"saved {path}")


def _token_counts(r):
    """``(r_layer, tokens before the layer)`` for the schedule ``r``."""
    n = GRID * GRID + 1
    for v in tome.parse_r(LAYERS, r):
        yield v, n
        n -= max(0, min(v, (n - 1) // 2))


if __name__ == "__main__":
    main()

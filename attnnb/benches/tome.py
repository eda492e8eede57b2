"""Benchmark cases for :mod:`attnnb.tome` (see ``python -m attnnb bench``).

Each case times one ToMe step, matching plus a ``mean`` merge, at a ViT-B
layer (B = 32, N = 197, C = 64, r = 16, class token) and at a Stable
Diffusion 64 x 64 latent (B = 2, N = 4096, C = 320, r = 2048), against a
PyTorch CPU version of the same algorithm when torch is importable.
The PyTorch version lives here, not in the package: it is a yardstick.
"""

from __future__ import annotations

import math

import numpy as np

SIZES = {
    # name: (B, N, C, r, class_token)
    "vit": (32, 197, 64, 16, True),
    "sd": (2, 4096, 320, 2048, False),
}


def data(B, N, C, seed=0):
    """Metric and tokens of one ToMe step, float32."""
    rng = np.random.default_rng(seed)
    metric = rng.standard_normal((B, N, C)).astype(np.float32)
    x = rng.standard_normal((B, N, C)).astype(np.float32)
    return metric, x


def work(B, N, C):
    """Flops of the similarity matrix, the dominant cost."""
    return 2.0 * B * ((N + 1) // 2) * (N // 2) * C


def attnnb_step(metric, x, r, class_token, backend="cpu"):
    """Matching and a mean merge with :mod:`attnnb.tome`."""
    from attnnb import tome

    m = tome.bipartite_soft_matching(metric, r, class_token=class_token, backend=backend)
    return m.merge(x, "mean")


def torch_step(metric, x, r, class_token):
    """The reference algorithm written with PyTorch tensor operations (CPU).

    Cosine similarity of even against odd tokens, the best odd partner of
    every even token, the ``r`` best edges (``argsort`` descending), then
    a gather of the kept tokens and a ``scatter_reduce(mean)`` of the
    merged ones into their partners.
    """
    import torch

    with torch.no_grad():
        unit = metric / metric.norm(dim=-1, keepdim=True)
        sim = unit[:, ::2] @ unit[:, 1::2].transpose(1, 2)
        if class_token:
            sim[:, 0, :] = -math.inf
        best, partner = sim.max(dim=-1)
        ranked = best.argsort(dim=-1, descending=True).unsqueeze(-1)
        merged, kept = ranked[:, :r], ranked[:, r:]
        if class_token:
            kept = kept.sort(dim=1).values
        target = partner.unsqueeze(-1).gather(1, merged)
        evens, odds = x[:, ::2], x[:, 1::2]
        B, _, C = evens.shape
        stay = evens.gather(1, kept.expand(B, kept.shape[1], C))
        moved = evens.gather(1, merged.expand(B, r, C))
        odds = odds.scatter_reduce(1, target.expand(B, r, C), moved, reduce="mean")
        return torch.cat([stay, odds], dim=1)


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except Exception:
        return False
    return True


def cases(quick: bool) -> list[dict]:
    """``{"name", "work", "candidates"}`` for ``python -m attnnb bench``."""
    out = []
    for name, (B, N, C, r, cls) in SIZES.items():
        if quick and name == "sd":
            B = 1
        metric, x = data(B, N, C)
        candidates = {
            "attnnb-cpu": lambda metric=metric, x=x, r=r, cls=cls: attnnb_step(metric, x, r, cls),
            "numpy": lambda metric=metric, x=x, r=r, cls=cls:
                attnnb_step(metric, x, r, cls, backend="reference"),
        }
        if torch_available():
            import torch

            tm, tx = torch.from_numpy(metric), torch.from_numpy(x)
            candidates["torch"] = lambda tm=tm, tx=tx, r=r, cls=cls: torch_step(tm, tx, r, cls)
        out.append({"name": f"tome match+merge {name} B={B} N={N} C={C} r={r}",
                    "work": work(B, N, C), "candidates": candidates})
    return out

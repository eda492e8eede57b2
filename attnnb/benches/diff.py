"""Benchmark cases for :func:`attnnb.diff_attention` (see ``python -m attnnb bench``).

The fused kernel (first candidate) against what a user would write without
it, on the same data, float32, ``H`` head pairs of width ``d`` and values of
width ``2d``:

* ``attention x2``: two :func:`attnnb.attention` calls on the two
  components, split beforehand (the work of the fused kernel, as two calls;
  target: the fused kernel costs at most 1.1x);
* ``attention x2 + numpy``: the same from the packed layout, as the
  reference's ``multihead_flashdiff_1`` composes it: split the heads, two
  calls, ``o1 - lam * o2`` (target: the fused kernel is faster);
* ``numpy``: the float64 reference (materialises both maps; small sizes only);
* ``torch``: two ``scaled_dot_product_attention`` calls and the subtraction,
  when PyTorch is importable.

And the Heaviside mode against the rectified one, whose passes it shares,
forward and forward + backward (target: at most 1.1x).
"""

from __future__ import annotations

import numpy as np

SIZES = {
    # name: (B, H pairs, Hk pairs, L, d)
    "B=8 H=8 d=64 L=256": (8, 8, 8, 256, 64),
    "H=8 d=64 L=1024": (1, 8, 8, 1024, 64),
    "H=8 d=64 L=2048 GQA Hk=2": (1, 8, 2, 2048, 64),
}
QUICK = {"H=4 d=64 L=512": (1, 4, 4, 512, 64)}


def data(B, H, Hk, L, d, seed=0, dtype=np.float32):
    """Packed ``q (B, 2H, L, d)``, ``k (B, 2Hk, L, d)``, ``v (B, Hk, L, 2d)`` and ``lam (H, 1)``."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, 2 * H, L, d)).astype(dtype)
    k = rng.standard_normal((B, 2 * Hk, L, d)).astype(dtype)
    v = rng.standard_normal((B, Hk, L, 2 * d)).astype(dtype)
    lam = rng.uniform(0.2, 0.8, (H, 1)).astype(dtype)
    return q, k, v, lam


def work(B, H, L, d, dv, causal=False):
    """Flops of both maps: ``Q K^T`` and ``P V`` for each (halved when causal).

    The rectified mode is given the same nominal work (it recomputes ``Q K^T``
    in its second pass and does one ``P V`` instead of two).
    """
    flops = 2.0 * B * H * L * L * (2 * d + 2 * dv)
    return flops / 2 if causal else flops


def composed(q, k, v, lam, causal=False, backend="cpu"):
    """Differential attention from two attention() calls plus NumPy (flashdiff_1's way)."""
    from attnnb import attention

    o1 = attention(q[:, 0::2], k[:, 0::2], v, causal=causal, backend=backend)
    o2 = attention(q[:, 1::2], k[:, 1::2], v, causal=causal, backend=backend)
    return o1 - lam[..., None] * o2


def torch_composed(tq, tk, tv, tlam, causal=False):
    """The same with PyTorch's SDPA (GQA through ``repeat_interleave`` of the key pairs)."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        rep = tq.shape[1] // tk.shape[1]
        k1, k2 = tk[:, 0::2], tk[:, 1::2]
        v = tv
        if rep > 1:
            k1, k2, v = (x.repeat_interleave(rep, dim=1) for x in (k1, k2, tv))
        o1 = F.scaled_dot_product_attention(tq[:, 0::2], k1, v, is_causal=causal)
        o2 = F.scaled_dot_product_attention(tq[:, 1::2], k2, v, is_causal=causal)
        return o1 - tlam[..., None] * o2


def _torch():
    try:
        import torch
    except Exception:
        return None
    return torch


def case(name, B, H, Hk, L, d, *, causal=False, mode="difference", reference=False):
    """One bench case: the fused kernel and its yardsticks on the same data."""
    from attnnb import attention, diff_attention

    q, k, v, lam = data(B, H, Hk, L, d)
    q1, q2 = np.ascontiguousarray(q[:, 0::2]), np.ascontiguousarray(q[:, 1::2])
    k1, k2 = np.ascontiguousarray(k[:, 0::2]), np.ascontiguousarray(k[:, 1::2])
    candidates = {
        "attnnb-cpu": lambda: diff_attention(q, k, v, lam, causal=causal, mode=mode),
        "attention x2": lambda: (attention(q1, k1, v, causal=causal),
                                 attention(q2, k2, v, causal=causal)),
    }
    if mode == "difference":
        candidates["attention x2 + numpy"] = lambda: composed(q, k, v, lam, causal)
    if reference:
        candidates["numpy"] = lambda: diff_attention(q, k, v, lam, causal=causal, mode=mode,
                                                     backend="reference")
    torch = _torch()
    if torch is not None and mode == "difference":
        tq, tk, tv, tlam = (torch.from_numpy(x) for x in (q, k, v, lam))
        candidates["torch"] = lambda: torch_composed(tq, tk, tv, tlam, causal)
    label = f"diff_attention {mode} {name}" + (" causal" if causal else "")
    return {"name": label, "work": work(B, H, L, d, 2 * d, causal), "candidates": candidates}


def gated_case(name, B, H, Hk, L, d, *, backward=False):
    """The Heaviside mode against the rectified mode (forward, or forward + backward)."""
    from attnnb import diff_attention, vjp

    q, k, v, lam = data(B, H, Hk, L, d)

    def run(mode):
        if not backward:
            return diff_attention(q, k, v, lam, causal=True, mode=mode)
        out, pullback = vjp(diff_attention, q, k, v, lam, causal=True, mode=mode)
        return pullback(out)

    what = "forward+backward" if backward else "forward"
    return {"name": f"diff_attention heaviside vs rectified {what} {name} causal",
            "work": work(B, H, L, d, 2 * d, True) * (3 if backward else 1),
            "candidates": {mode: (lambda m=mode: run(m)) for mode in ("rectified",
                                                                      "heaviside")}}


def cases(quick: bool) -> list[dict]:
    """``{"name", "work", "candidates"}`` for ``python -m attnnb bench``."""
    out = []
    sizes = QUICK if quick else SIZES
    for name, (B, H, Hk, L, d) in sizes.items():
        out.append(case(name, B, H, Hk, L, d, reference=quick))
        out.append(case(name, B, H, Hk, L, d, causal=True))
        out.append(case(name, B, H, Hk, L, d, mode="rectified"))
    name, (B, H, Hk, L, d) = next(iter(QUICK.items())) if quick else (
        "H=8 d=64 L=2048", (1, 8, 8, 2048, 64))
    out.extend(gated_case(name, B, H, Hk, L, d, backward=b) for b in (False, True))
    return out

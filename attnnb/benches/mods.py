"""Benchmark cases: mask and score functions (see ``python -m attnnb bench``).

Dense attention on the cpu backend, float32, B = 1, H = 8, D = 64, causal.

* ALiBi at N = 2048: the same logits as a materialised ``bias`` (the first
  candidate), ``mods.alibi``, the same function written as a user's
  ``score_mod``, and no mod at all; ``mods.softcap`` against no mod.
* A document mask of 8 documents of N / 8 at N = 16384 (1024 quick), with
  ``causal``: ``mods.document`` against ``sparse_attention`` with the
  equivalent pattern (built once, outside the timing) and against dense
  causal attention.

Forward, and forward + backward through :func:`attnnb.vjp`.

* Against PyTorch (``torch`` installed): forward + backward of ALiBi and of the
  document mask at N = 2048 (512 quick), attnnb's mods against
  ``scaled_dot_product_attention`` with the same logits as a materialised
  float mask (the bias with ``-inf`` above the diagonal) or boolean mask, each
  in fresh processes (median ms of a process's steps; the rounds alternate).
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np

from .attention import run_python, timed_tail

H, D = 8, 64


def user_alibi(s, b, h, i, j, slopes):
    """ALiBi as a user writes it (queries and keys of one length)."""
    return s + slopes[h] * (j - i)


def user_alibi_grad(g, s, b, h, i, j, grads, slopes):
    grads[0][h] += g * (j - i)


def _data(N, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((1, H, N, D)).astype(np.float32) for _ in range(3))


def _runner(q, k, v, backward, fn=None, **kwargs):
    from attnnb import attention, vjp

    os.environ["ATTNNB_FIRST_TIER"] = "0"  # the steady state: the kernels made for a mod
    fn = attention if fn is None else fn

    def run():
        if not backward:
            return fn(q, k, v, backend="cpu", **kwargs)
        out, pullback = vjp(fn, q, k, v, backend="cpu", **kwargs)
        return pullback(out)

    return run


def alibi_case(N, backward):
    from attnnb import mods

    q, k, v = _data(N)
    slopes = 2.0 ** -np.arange(1, H + 1, dtype=np.float32)
    i, j = np.arange(N)[:, None], np.arange(N)[None, :]
    bias = (slopes[:, None, None] * (j - i)).astype(np.float32)
    user = mods.score_mod(user_alibi, slopes, grad_s=lambda s, b, h, i, j, slopes: 1.0,
                          grad_arrays=user_alibi_grad)
    what = "forward+backward" if backward else "forward"
    return {"name": f"mods alibi {what} f32 H={H} N={N} D={D} causal",
            "work": 4.0 * H * N * N * D / 2 * (3.5 if backward else 1.0),
            "candidates": {
                "bias": _runner(q, k, v, backward, causal=True, bias=bias),
                "alibi": _runner(q, k, v, backward, causal=True, score_mod=mods.alibi(slopes)),
                "user alibi": _runner(q, k, v, backward, causal=True, score_mod=user),
                "softcap": _runner(q, k, v, backward, causal=True,
                                   score_mod=mods.softcap(20.0)),
                "no mod": _runner(q, k, v, backward, causal=True)}}


def document_case(N, backward):
    from attnnb import mods, patterns, sparse_attention

    q, k, v = _data(N)
    ids = np.arange(N) // (N // 8)
    mask = (ids[:, None] == ids[None, :]) & (np.arange(N)[None, :] <= np.arange(N)[:, None])
    pattern = patterns.from_mask(mask)
    del mask
    what = "forward+backward" if backward else "forward"
    return {"name": f"mods document {what} f32 H={H} N={N} D={D} 8 docs causal",
            "work": 4.0 * H * N * N * D / 16 * (3.5 if backward else 1.0),
            "candidates": {
                "pattern": _runner(q, k, v, backward, fn=sparse_attention, pattern=pattern),
                "document": _runner(q, k, v, backward, causal=True,
                                    mask_mod=mods.document(ids)),
                "dense causal": _runner(q, k, v, backward, causal=True)}}


_SDPA_SCRIPT = r"""
import sys, time
import numpy as np
impl, what, N, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
H, D = 8, 64
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, H, N, D)).astype(np.float32) for _ in range(3))
slopes = 2.0 ** -np.arange(1, H + 1, dtype=np.float32)
ids = np.arange(N) // (N // 8)
i, j = np.arange(N)[:, None], np.arange(N)[None, :]
if impl == "sdpa":
    import torch
    if what == "alibi":
        mask = np.where(j <= i, slopes[:, None, None] * (j - i), -np.inf).astype(np.float32)
    else:
        mask = (ids[:, None] == ids[None, :]) & (j <= i)
    mask = torch.from_numpy(mask)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    def run():
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask)
        out.backward(out.detach())
else:
    import attnnb
    from attnnb import mods
    kw = dict(score_mod=mods.alibi(slopes)) if what == "alibi" else dict(
        mask_mod=mods.document(ids))
    def run():
        out, pullback = attnnb.vjp(attnnb.attention, q, k, v, causal=True, backend="cpu", **kw)
        pullback(out)
""" + timed_tail("run", "steps", warmup=2)


def sdpa_case(N, quick):
    steps = 3 if quick else 7
    cands = {}
    for what in ("alibi", "document"):
        for impl in ("attnnb", "sdpa"):
            cands[f"{impl} {what}"] = (lambda i=impl, w=what: run_python(
                _SDPA_SCRIPT, i, w, N, steps, env={"OMP_WAIT_POLICY": "PASSIVE"}))
    return {"name": f"mods vs SDPA forward+backward f32 H={H} N={N} D={D} causal (ms, fresh "
                    "processes)", "work": None, "candidates": cands, "measure": "value",
            "unit": "ms", "repeats": 1 if quick else 3}


def cases(quick: bool) -> list[dict]:
    """``{"name", "work", "candidates"}`` for ``python -m attnnb bench``."""
    n_alibi, n_doc = (256, 1024) if quick else (2048, 16384)
    out = ([alibi_case(n_alibi, backward) for backward in (False, True)]
           + [document_case(n_doc, backward) for backward in (False, True)])
    if importlib.util.find_spec("torch") is not None:
        out.append(sdpa_case(512 if quick else 2048, quick))
    return out

"""Benchmark cases: attention inside a PyTorch training step (see ``python -m attnnb bench``).

One step of a small model in PyTorch: ``x (B, N, H*D) -> Linear -> q, k, v
-> attention (causal) -> Linear -> mean square -> backward``, float32, with
the attention either ``torch.nn.functional.scaled_dot_product_attention`` or
``attnnb.torch.attention``.  Every figure is the median step time (ms) of
one fresh process, so that neither candidate inherits the other's threads;
the rounds alternate the candidates.

The two environments show the interference the step suffers: PyTorch's
OpenMP threads keep spinning after each of its operators (libgomp's default
wait policy), and a Numba parallel region that starts right after one
competes with them for the cores.  ``OMP_WAIT_POLICY=PASSIVE`` (read when
torch loads its OpenMP runtime, so it must be set before ``import torch``)
makes them sleep at once.
"""

from __future__ import annotations

import importlib.util

from .attention import run_python, timed_tail

_STEP_SCRIPT = r"""
import sys, time
import numpy as np
import torch
impl = sys.argv[1]
B, H, N, D, steps = (int(x) for x in sys.argv[2:7])
torch.manual_seed(0)
C = H * D
lin_in, lin_out = torch.nn.Linear(C, 3 * C), torch.nn.Linear(C, C)
x = torch.randn(B, N, C)
if impl == "sdpa":
    attention = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True)
else:
    import attnnb.torch
    attention = lambda q, k, v: attnnb.torch.attention(q, k, v, causal=True)

def step():
    q, k, v = lin_in(x).reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
    y = lin_out(attention(q, k, v).transpose(1, 2).reshape(B, N, C))
    y.square().mean().backward()
""" + timed_tail("step", "steps", warmup=3)

SHAPES = ((1, 8, 1024, 64), (32, 6, 197, 64))


def _step_ms(impl, shape, steps, env):
    return run_python(_STEP_SCRIPT, impl, *shape, steps, env=env)


def cases(quick: bool) -> list[dict]:
    if importlib.util.find_spec("torch") is None:
        raise ImportError("torch is not installed: no training-step rows")
    steps = 3 if quick else 10
    shapes = SHAPES[:1] if quick else SHAPES
    out = []
    for shape in shapes:
        B, H, N, D = shape
        cands = {}
        for policy in ("", "PASSIVE"):
            env = {"OMP_WAIT_POLICY": policy}  # "": libgomp's default, whatever the parent has
            tag = f" {policy}" if policy else ""
            for impl in ("attnnb", "sdpa"):
                cands[f"{impl}{tag}"] = (lambda i=impl, s=shape, e=env:
                                         _step_ms(i, s, steps, e))
        out.append({"name": f"torch step f32 B={B} H={H} N={N} D={D} causal (ms/step, "
                            "fresh processes)", "work": None, "candidates": cands,
                    "measure": "value", "unit": "ms", "repeats": 1 if quick else 3})
    return out

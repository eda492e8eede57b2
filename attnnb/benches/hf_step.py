"""Benchmark cases: a HuggingFace model's training step through attnnb (``python -m attnnb bench``).

A small Llama-style model (``transformers.LlamaConfig``: 4 layers, 8 heads of
64, random weights) takes AdamW steps on batches of random tokens with
``attn_implementation="sdpa"`` (PyTorch's kernels) or ``"attnnb"``
(:mod:`attnnb.transformers`), with the attention dropout of the config at 0
or 0.1; and the drop-in's per-call time at a decoding shape (one query
against 512 cached keys) against PyTorch's.  Every figure is the median of
one fresh process; the rounds alternate the candidates.
"""

from __future__ import annotations

import importlib.util

from .attention import run_python, timed_tail

_STEP_SCRIPT = r"""
import sys, time
import numpy as np
import torch
import transformers
impl, dropout = sys.argv[1], float(sys.argv[2])
B, N, layers, steps = (int(x) for x in sys.argv[3:7])
if impl == "attnnb":
    import attnnb.transformers
    attnnb.transformers.register()
torch.manual_seed(0)
config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1376, vocab_size=1000,
                                  num_hidden_layers=layers, num_attention_heads=8,
                                  num_key_value_heads=8, attention_dropout=dropout,
                                  max_position_embeddings=N)
model = transformers.LlamaForCausalLM(config).train()
model.set_attn_implementation(impl)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
ids = torch.randint(0, 1000, (B, N))

def step():
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
""" + timed_tail("step", "steps")

_DECODE_SCRIPT = r"""
import sys, time
import numpy as np
import torch
impl = sys.argv[1]
Lk, calls = int(sys.argv[2]), int(sys.argv[3])
if impl == "attnnb":
    import attnnb.torch
    sdpa = attnnb.torch.scaled_dot_product_attention
else:
    sdpa = torch.nn.functional.scaled_dot_product_attention
torch.manual_seed(0)
q = torch.randn(1, 8, 1, 64)
k, v = torch.randn(1, 8, Lk, 64), torch.randn(1, 8, Lk, 64)
with torch.no_grad():
    for _ in range(20):
        sdpa(q, k, v)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        sdpa(q, k, v)
        times.append(time.perf_counter() - t)
print(1e6 * float(np.median(times)))
"""


def cases(quick: bool) -> list[dict]:
    if importlib.util.find_spec("transformers") is None:
        raise ImportError("transformers is not installed: no HuggingFace training-step rows")
    B, N, layers, steps = (1, 128, 1, 2) if quick else (4, 512, 4, 5)
    repeats = 1 if quick else 3
    step = {}
    for dropout in (0.0, 0.1):
        for impl in ("attnnb", "sdpa"):
            step[f"{impl} dropout {dropout}"] = (
                lambda i=impl, d=dropout: run_python(_STEP_SCRIPT, i, d, B, N, layers, steps))
    decode = {impl: (lambda i=impl: run_python(_DECODE_SCRIPT, i, 512, 200 if quick else 2000))
              for impl in ("attnnb", "sdpa")}
    return [
        {"name": f"Llama train step f32 B={B} N={N} layers={layers} H=8 D=64 AdamW "
                 "(ms/step, fresh processes)", "work": None, "candidates": step,
         "measure": "value", "unit": "ms", "repeats": repeats},
        {"name": "SDPA drop-in decoding Lq=1 Lk=512 H=8 D=64 (us/call, fresh processes)",
         "work": None, "candidates": decode, "measure": "value", "unit": "us",
         "repeats": repeats},
    ]

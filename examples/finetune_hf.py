"""Train a HuggingFace transformers model through attnnb, attention dropout included.

A small Llama-style causal language model (``transformers.LlamaConfig``: 2
layers, width 128, 4 heads of 32, random initial weights, nothing
downloaded) learns a copying task: each sequence is 16 random tokens, a
separator, and the same 16 tokens again; the loss counts the second half
only, which the model can predict only by attending back to the first.
The config's attention dropout is 0.1, so training runs dropout inside the
attention kernels.

The same model (same initial weights, same batches) is trained twice, with
``attn_implementation="attnnb"`` (:mod:`attnnb.transformers`: the kernels
of :mod:`attnnb.torch`, dropout drawn per weight by attnnb's generator) and
with ``"sdpa"`` (PyTorch's kernels and dropout).  The two draw different
dropout masks, so the curves are two samples of the same training, not
copies; the script prints both routes' step times, final losses and
copying accuracies (greedy, eval mode), and saves the loss curves to
``examples/out/finetune_hf.png``.

Run: ``python examples/finetune_hf.py [--steps 300]`` (``pip install
"attnnb[transformers]" matplotlib``; about half a minute on two cores).
"""

from __future__ import annotations

import argparse
import os
import time

# Torch's OpenMP threads keep spinning after each operator and take the cores
# from the next attnnb call (docs/notes/performance.md, "Inside a PyTorch program").
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import attnnb.transformers  # noqa: E402

HALF, VOCAB, BATCH = 16, 64, 32
SEP = VOCAB - 1
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, labels)``: ``x SEP x`` with labels only on the copy (-100 elsewhere)."""
    x = torch.randint(0, SEP, (BATCH, HALF), generator=gen)
    ids = torch.cat([x, torch.full((BATCH, 1), SEP), x], dim=1)
    labels = ids.clone()
    labels[:, : HALF + 1] = -100
    return ids, labels


def model_for(impl: str) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)  # the same initial weights for both routes
    config = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=2 * HALF + 1,
        attention_dropout=0.1)
    model = transformers.LlamaForCausalLM(config)
    model.set_attn_implementation(impl)
    return model


def copy_accuracy(model, gen: torch.Generator) -> float:
    """Share of the copied tokens predicted right (teacher forcing, greedy, eval mode)."""
    model.eval()
    ids, labels = batch(gen)
    with torch.no_grad():
        pred = model(input_ids=ids).logits.argmax(-1)
    model.train()
    target = labels[:, 1:]
    seen = target != -100
    return float((pred[:, :-1][seen] == target[seen]).float().mean())


def train(impl: str, steps: int) -> tuple[list[float], float, float]:
    """Train ``impl``'s model; returns its losses, median step time (ms), accuracy."""
    model = model_for(impl).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)  # the same batches for both routes
    torch.manual_seed(2)
    losses, times = [], []
    for _ in range(steps):
        ids, labels = batch(gen)
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
        losses.append(float(loss.detach()))
    return losses, 1e3 * float(np.median(times)), copy_accuracy(model, gen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    attnnb.transformers.register()
    runs = {impl: train(impl, args.steps) for impl in ("attnnb", "sdpa")}
    for impl, (losses, ms, acc) in runs.items():
        tail = float(np.mean(losses[-20:]))
        print(f"{impl:6s}  step {ms:6.1f} ms  loss (last 20 steps) {tail:.3f}  "
              f"copy accuracy {100 * acc:.1f} %")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no picture")
        return
    os.makedirs(OUT, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for impl, (losses, _, _) in runs.items():
        ax.plot(losses, label=f'attn_implementation="{impl}"', lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss on the copy (nats)")
    ax.set_title("Llama-style model, attention dropout 0.1")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(OUT, "finetune_hf.png")
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


if __name__ == "__main__":
    main()

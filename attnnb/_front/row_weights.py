"""The exact weights of chosen query rows of any attention call, in float64.

A row's weights depend on its own logits and nothing else, so they can be
recomputed for the rows asked alone: ``n`` rows cost ``n * Lk`` memory and
``n * Lk * D`` work, whatever ``Lq``.  The arithmetic is the reference
backend's (:mod:`attnnb.reference`: the same logits, allowed sets,
normalizers, top-k ranking and dropout decisions) applied to those rows, so
the weights are the reference's materialised ones exactly, for every
function and option (docs/contract.md §2.9).

:func:`bind_call` validates a call as the function itself would and
:func:`row_weights` forms the weights of a block of its rows.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._core.dropout import keep_mask, keep_scale
from .._dask import any_dask
from ..attention import attention
from ..diff import diff_attention
from ..patterns import Pattern
from ..reference._common import expand_kv_heads, mask_mod_values, normalize, problem_logits
from ..reference.attention import sink_of
from ..reference.diff import heaviside_gate, pair_key_heads
from ..reference.topk import topk_selection
from ..sparse import sparse_attention, topk_attention
from .checks import is_device_array
from .function_args import check_head_axis, check_mode, check_pattern, check_top_k, lambda_rows
from .validate import Problem, attention_problem, check_bool

FUNCTIONS = (attention, sparse_attention, topk_attention, diff_attention)


@dataclass(frozen=True)
class Call:
    """An attention call, validated: what its weights depend on.

    ``name`` is the function's; ``problem`` the canonical problem (host
    arrays, compute dtype); ``pattern`` (sparse), ``top_k`` (top-k), ``lam``
    ``(B, H, Lq)`` and ``mode`` (differential) the function's own arguments;
    ``backend`` the one it names.
    """

    name: str
    problem: Problem
    backend: str | None = None
    pattern: Pattern | None = None
    top_k: int | None = None
    lam: np.ndarray | None = None
    mode: str | None = None

    @property
    def heads(self) -> int:
        """Heads of the weights: query heads, or head pairs for differential attention."""
        Hq = self.problem.shape[1]
        return Hq // 2 if self.name == "diff_attention" else Hq

    @property
    def out_shape(self) -> tuple:
        """The user's leading axes of a weights array: ``(*batch, H)``, or ``()`` for
        2-D input."""
        p = self.problem
        return p.batch_shape + (() if p.squeeze_head else (self.heads,))


def _host(name, x):
    """A device array's copy on the host; anything else as it is."""
    if is_device_array(x):
        from .device import device_view  # imports numba.cuda: device arrays only

        return device_view(x, name=name, need_reshape=False).copy_to_host()
    return x


def bind_call(caller: str, fn, args, kwargs) -> Call:
    """Validate ``fn(*args, **kwargs)`` as ``fn`` would (its errors, its messages).

    ``caller`` names the public function in the error for an unsupported
    ``fn``.  Device arrays are copied to the host; Dask arrays are refused.
    """
    if not any(fn is f for f in FUNCTIONS):
        names = ", ".join(f"attnnb.{f.__name__}" for f in FUNCTIONS)
        raise TypeError(f"{caller} supports {names}; got {fn!r}")
    a = inspect.signature(fn).bind(*args, **kwargs)
    a.apply_defaults()
    a = {n: _host(n, x) for n, x in a.arguments.items()}
    if any_dask(a["q"], a["k"], a["v"]):
        raise NotImplementedError(f"{caller} of Dask arrays: compute the arrays first")
    check_bool("return_lse", a.get("return_lse", False))
    common = dict(key_size=a["key_size"], scale=a["scale"], dropout_p=a["dropout_p"],
                  seed=a["seed"])
    name = fn.__name__
    if name == "diff_attention":
        check_mode(a["mode"])
        problem = attention_problem(a["q"], a["k"], a["v"], mask=a["mask"], bias=a["bias"],
                                    causal=a["causal"], head_pairs=True,
                                    mask_mod=a["mask_mod"], score_mod=a["score_mod"], **common)
        check_head_axis(problem.squeeze_head, np.shape(problem.q)[2:])
        B, H2, _, Lq = problem.shape[:4]
        # lam as the call computes with it: in the compute dtype
        lam = lambda_rows(a["lam"], problem.batch_shape, B, H2 // 2, Lq,
                          problem.compute_dtype).astype(np.float64)
        return Call(name, problem, a["backend"], lam=lam, mode=a["mode"])
    common.update(normalizer=a.get("normalizer", "softmax"), sinks=a["sinks"])
    if "sigmoid_bias" in a:
        common["sigmoid_bias"] = a["sigmoid_bias"]
    if name == "sparse_attention":
        problem = attention_problem(a["q"], a["k"], a["v"], mask_mod=a["mask_mod"],
                                    score_mod=a["score_mod"], **common)
        _, Hq, _, Lq, Lk = problem.shape[:5]
        return Call(name, problem, a["backend"],
                    pattern=check_pattern(a["pattern"], Lq, Lk, Hq))
    masks = dict(mask=a["mask"], causal=a["causal"])
    if name == "topk_attention":
        top_k = check_top_k(a["top_k"])
        return Call(name, attention_problem(a["q"], a["k"], a["v"], **masks,
                                            mask_mod=a["mask_mod"], score_mod=a["score_mod"],
                                            **common), a["backend"], top_k=top_k)
    return Call(name, attention_problem(a["q"], a["k"], a["v"], bias=a["bias"], **masks,
                                        mask_mod=a["mask_mod"], score_mod=a["score_mod"],
                                        **common), a["backend"])


def row_indices(rows: Any, Lq: int) -> np.ndarray:
    """``rows`` (None: all; a slice; an integer or integer array, negative counting from
    the end) as an int64 array of query positions in ``[0, Lq)``."""
    if rows is None:
        return np.arange(Lq, dtype=np.int64)
    if isinstance(rows, slice):
        return np.arange(Lq, dtype=np.int64)[rows]
    idx = np.asarray(rows)
    if idx.dtype == np.bool_ or idx.dtype.kind not in "iu" or idx.ndim > 1:
        raise TypeError("rows must be None, a slice, or an integer or 1-D integer array of "
                        f"query positions; got {type(rows).__name__}"
                        + (f" of dtype {idx.dtype} and shape {idx.shape}"
                           if hasattr(rows, "dtype") else f" {rows!r}"))
    idx = idx.astype(np.int64).reshape(-1)
    bad = (idx < -Lq) | (idx >= Lq)
    if bad.any():
        raise IndexError(f"rows holds {idx[bad][0]}, outside the {Lq} queries")
    return np.where(idx < 0, idx + Lq, idx)


def _pattern_rows(pattern: Pattern, rows: np.ndarray) -> np.ndarray:
    """Boolean ``(n_heads, n, Lk)``: the pattern's rows ``rows`` (CSR, no full mask)."""
    Lq, Lk = pattern.shape
    out = np.zeros((pattern.n_heads, rows.size, Lk), bool)
    for ph in range(pattern.n_heads):
        starts = pattern.indptr[ph * Lq + rows]
        counts = pattern.indptr[ph * Lq + rows + 1] - starts
        at = np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
        out[ph, np.repeat(np.arange(rows.size), counts), pattern.indices[at]] = True
    return out


def _allowed_rows(call: Call, rows: np.ndarray) -> np.ndarray:
    """Boolean ``(B, H, n, Lk)``: the mask, the causal limit and the pattern, on ``rows``."""
    p = call.problem
    B, Lq, Lk = p.shape[0], p.shape[3], p.shape[4]
    allowed = np.ones((B, call.heads, rows.size, Lk), bool)
    if p.mask is not None:
        allowed &= p.mask[:, :, rows]
    if p.causal:
        allowed &= np.arange(Lk)[None, :] <= rows[:, None] + (Lk - Lq)
    if call.pattern is not None:
        allowed &= _pattern_rows(call.pattern, rows)[None]
    by_mod = mask_mod_values(p, (B, call.heads, Lq, Lk), rows)
    return allowed if by_mod is None else allowed & by_mod


def _dropout_rows(call: Call, rows: np.ndarray, shape) -> np.ndarray | None:
    """float64 factors ``z`` of the weights on ``rows`` (docs/contract.md §1.14), or None."""
    p = call.problem
    if not p.dropout_p:
        return None
    b0, h0 = p.dropout_origin
    B, H = shape[:2]
    keep = keep_mask(p.seed, p.dropout_p, shape, b=b0 + np.arange(B), h=h0 + np.arange(H),
                     i=rows)
    return np.where(keep, keep_scale(p.dropout_p), 0.0)


def row_weights(call: Call, rows: np.ndarray):
    """The weights of query rows ``rows`` of a call, float64 ``(B, H, n, Lk)``.

    Returns ``(w, allowed, maps)``: the weights that multiply ``v`` in the
    call (dropout included), the allowed set (for top-k, the keys kept), and
    for differential attention the two softmax maps ``(A1, A2)`` before
    dropout (None otherwise).
    """
    p = call.problem
    lks = None if p.log_key_size is None else p.log_key_size.astype(np.float64)
    allowed = _allowed_rows(call, rows)
    maps = None
    if call.name == "diff_attention":
        heads = pair_key_heads(call.heads, p.shape[2] // 2)
        maps = tuple(
            normalize(problem_logits(dataclasses.replace(p, q=p.q[:, c::2]), p.k[:, heads[:, c]],
                                     rows=rows)[0], allowed, lks, "softmax")[0]
            for c in range(2))
        lam = call.lam[:, :, rows, None]
        if call.mode == "heaviside":
            w = maps[0] - lam * heaviside_gate(maps[0], maps[1], lam)
        else:
            w = maps[0] - lam * maps[1]
        if call.mode == "rectified":
            w = np.maximum(w, 0.0)  # NaN rows stay NaN
    else:
        s = problem_logits(p, expand_kv_heads(p.k, call.heads), rows=rows)[0]
        if call.top_k is not None:
            allowed = topk_selection(s, allowed, lks, call.top_k)
        w, _ = normalize(s, allowed, lks, p.normalizer, sink_of(p))
    factors = _dropout_rows(call, rows, w.shape)
    if factors is not None:
        w = w * factors
    return w, allowed, maps

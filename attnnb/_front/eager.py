"""The four attention functions on arrays in memory (NumPy, or a GPU's device arrays).

Each validates its arguments, calls the chosen backend through the
dispatcher and gives the result the caller's shape.  The public functions
(:mod:`attnnb.attention`, :mod:`attnnb.sparse`, :mod:`attnnb.diff`, whose
docstrings are the reference) send Dask arrays to :mod:`attnnb._dask` and
everything else here; the Dask tasks run these on each block.  So both sit
above this module, and the imports have no loop.
"""

from __future__ import annotations

import numpy as np

from . import dispatch as _dispatch
from .function_args import check_head_axis, check_mode, check_pattern, check_top_k, lambda_rows
from .validate import attention_problem, check_bool, compute_dtypes


def attention(q, k, v, *, mask=None, bias=None, key_size=None, causal=False, scale=None,
              normalizer="softmax", return_lse=False, dropout_p=0.0, seed=None, sinks=None,
              sigmoid_bias=None, mask_mod=None, score_mod=None, backend=None):
    """:func:`attnnb.attention` of in-memory arrays."""
    return_lse = check_bool("return_lse", return_lse)
    problem = attention_problem(q, k, v, mask=mask, bias=bias, key_size=key_size,
                                causal=causal, scale=scale, normalizer=normalizer,
                                dropout_p=dropout_p, seed=seed, sinks=sinks,
                                sigmoid_bias=sigmoid_bias, mask_mod=mask_mod,
                                score_mod=score_mod)
    out, lse = _dispatch.call("attention", backend, problem.on_device, problem)
    out, lse = problem.restore(out, lse)
    return (out, lse) if return_lse else out


def sparse_attention(q, k, v, pattern, *, key_size=None, scale=None, normalizer="softmax",
                     return_lse=False, dropout_p=0.0, seed=None, sinks=None, sigmoid_bias=None,
                     mask_mod=None, score_mod=None, backend=None):
    """:func:`attnnb.sparse_attention` of in-memory arrays."""
    return_lse = check_bool("return_lse", return_lse)
    problem = attention_problem(q, k, v, key_size=key_size, scale=scale, normalizer=normalizer,
                                dropout_p=dropout_p, seed=seed, sinks=sinks,
                                sigmoid_bias=sigmoid_bias, mask_mod=mask_mod,
                                score_mod=score_mod)
    B, Hq, _, Lq, Lk, _, _ = problem.shape
    check_pattern(pattern, Lq, Lk, Hq)
    out, lse = _dispatch.call("sparse_attention", backend, problem.on_device, problem, pattern)
    out, lse = problem.restore(out, lse)
    return (out, lse) if return_lse else out


def topk_attention(q, k, v, top_k, *, mask=None, causal=False, key_size=None, scale=None,
                   normalizer="softmax", return_lse=False, dropout_p=0.0, seed=None,
                   sinks=None, sigmoid_bias=None, mask_mod=None, score_mod=None, backend=None):
    """:func:`attnnb.topk_attention` of in-memory arrays."""
    return_lse = check_bool("return_lse", return_lse)
    top_k = check_top_k(top_k)
    problem = attention_problem(q, k, v, mask=mask, key_size=key_size, causal=causal,
                                scale=scale, normalizer=normalizer, dropout_p=dropout_p,
                                seed=seed, sinks=sinks, sigmoid_bias=sigmoid_bias,
                                mask_mod=mask_mod, score_mod=score_mod)
    out, lse = _dispatch.call("topk_attention", backend, problem.on_device, problem, top_k)
    out, lse = problem.restore(out, lse)
    return (out, lse) if return_lse else out


def diff_attention(q, k, v, lam, *, mask=None, bias=None, key_size=None, causal=False,
                   scale=None, mode="difference", dropout_p=0.0, seed=None, sinks=None,
                   mask_mod=None, score_mod=None, backend=None):
    """:func:`attnnb.diff_attention` of in-memory arrays."""
    check_mode(mode)
    problem = attention_problem(q, k, v, mask=mask, bias=bias, key_size=key_size,
                                causal=causal, scale=scale, head_pairs=True,
                                dropout_p=dropout_p, seed=seed, sinks=sinks, mask_mod=mask_mod,
                                score_mod=score_mod)
    check_head_axis(problem.squeeze_head, np.shape(problem.q)[2:])
    B, H2, _, Lq, _, _, Dv = problem.shape
    H = H2 // 2
    comp = compute_dtypes(problem.q.dtype, problem.k.dtype, problem.v.dtype)[0]  # device too
    lam_b = lambda_rows(lam, problem.batch_shape, B, H, Lq, comp)
    out = _dispatch.call("diff_attention", backend, problem.on_device, problem, lam_b, mode)
    out = out.reshape(problem.batch_shape + (H, Lq, Dv))
    if not problem.on_device:
        out = out.astype(problem.out_dtype, copy=False)
    return out

"""attnnb: attention kernels for NumPy and GPU arrays.

Dense softmax attention (masks, bias, causal, GQA, LSE, other normalizers),
Token Merging with proportional attention, differential attention and
sparse attention, on a float64 NumPy ``reference`` backend, a Numba ``cpu``
backend and a numba.cuda ``cuda`` backend behind one dispatcher; the exact
weights of any call and statistics of them (:mod:`attnnb.inspection`).

``import attnnb`` imports NumPy only; Numba loads on the first cpu call.
"""

import sys as _sys

from . import diff, patterns, tome
from ._front.dispatch import backends, use_backend
from .attention import attention
from .combine import combine
from .diff import diff_attention
from .inspection import attention_stats, weights
from .sparse import sparse_attention, topk_attention
from .vjp import vjp

__version__ = "0.1.0"


def release_buffers() -> None:
    """Free the working memory that the kernels keep from one call to the next.

    The ``cpu`` backend keeps one host buffer between calls: the keys laid
    out in transposed tiles for its matrix products, as large as the
    largest ``k`` seen so far (in the compute dtype), so that the next call
    does not pay for fresh memory.  This function frees it; the next cpu
    call allocates a new one.

    Returns
    -------
    None

    Notes
    -----
    Only backends that have already run in this process are touched: when
    no cpu kernel has been called, this does nothing and, in particular,
    does not import Numba.  It may be called at any time, also while other
    threads are computing: a call in progress keeps its buffer and hands it
    back to the pool when it finishes.

    Examples
    --------
    >>> import numpy as np, attnnb
    >>> q = k = v = np.ones((4, 8), np.float32)
    >>> out = attnnb.attention(q, k, v, backend="cpu")
    >>> attnnb.release_buffers()
    """
    scratch = _sys.modules.get("attnnb.cpu._scratch")
    if scratch is not None:
        scratch.release()

__all__ = [
    "attention",
    "attention_stats",
    "backends",
    "combine",
    "diff",
    "diff_attention",
    "patterns",
    "release_buffers",
    "sparse_attention",
    "tome",
    "topk_attention",
    "use_backend",
    "vjp",
    "weights",
    "__version__",
]

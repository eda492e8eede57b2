"""attnnb: attention kernels for NumPy and GPU arrays.

Dense softmax attention (masks, bias, causal, GQA, LSE, other normalizers),
Token Merging with proportional attention, differential attention and
sparse attention, on a float64 NumPy ``reference`` backend, a Numba ``cpu``
backend and a numba.cuda ``cuda`` backend behind one dispatcher.

``import attnnb`` imports NumPy only; Numba loads on the first cpu call.
"""

from . import diff, patterns
from ._dispatch import backends, use_backend
from .attention import attention
from .diff import diff_attention
from .sparse import sparse_attention, topk_attention

__version__ = "0.1.0"

__all__ = [
    "attention",
    "backends",
    "diff",
    "diff_attention",
    "patterns",
    "sparse_attention",
    "topk_attention",
    "use_backend",
    "__version__",
]

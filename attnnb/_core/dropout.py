"""The dropout generator: the keep decision of ``(seed, b, h, i, j)`` for every backend.

Dropout in attnnb is FlashAttention's: nothing ``(Lq, Lk)`` is stored, the
backward regenerates each decision, so the decision must be a pure function
of the seed and the element's four indices (``b`` the flattened batch, ``h``
the query head, ``i`` the query, ``j`` the key, all absolute), the same in
every function and backend (docs/contract.md §1.14).  It is a counter-based
generator built from one 32-bit mixing function, ``mix32`` (the
``lowbias32`` integer hash: xor-shifts and two odd multipliers, a bijection
of 32-bit words with full avalanche):

* a **row key** ``row_key(seed_lo, seed_hi, b, h, i)`` absorbs the 64-bit seed and the
  row's indices one 32-bit word at a time (``k = mix32(k ^ word)``);
* a **column word** ``column_word(j) = mix32(j ^ COLUMN_SALT)``, the same for
  every row (a kernel forms a key tile's 64 words once and reuses them for
  each of its rows);
* the element's word is ``mix32(row_key ^ column_word(j))``, and the key is
  **kept** when that word is at least ``threshold(p) = round(p * 2**32)``
  (a keep rate of ``1 - p`` to within ``2**-33``).

Not a cryptographic generator; the tests hold it to binomial bounds on the
keep rate, per row and per column, and to independence across seeds.

Everything is written in plain Python integer arithmetic on values below
``2**32`` (each product masked to 32 bits), so that one text compiles as
Numba ``njit`` and CUDA device functions (both wrap 64-bit products, whose
low 32 bits are the same) and runs as NumPy ``uint64`` array arithmetic for
the reference backend: the same bits on all three.  A backend compiles each function with
:func:`rebound`, which binds its calls of :func:`mix32` to the backend's
compiled mixer.
"""

from __future__ import annotations

import numbers

import numpy as np

from .specialise import global_names, rebind

WORD = 0xFFFFFFFF  # 32 bits
COLUMN_SALT = 0x3C6EF372  # keeps column words apart from row keys of the same integer
SEED_SALT = 0x9E3779B9


def mix32(x):
    """``lowbias32``: a bijection of 32-bit words with full avalanche (``x < 2**32``)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & WORD
    x ^= x >> 15
    x = (x * 0x846CA68B) & WORD
    x ^= x >> 16
    return x


def row_key(seed_lo, seed_hi, b, h, i):
    """The 32-bit key of row ``(b, h, i)`` under the seed ``seed_hi * 2**32 + seed_lo``
    (:func:`seed_words`; ``b, h, i`` below ``2**32``)."""
    k = mix32(seed_lo ^ SEED_SALT)
    k = mix32(k ^ seed_hi)
    k = mix32(k ^ (b & WORD))
    k = mix32(k ^ (h & WORD))
    return mix32(k ^ (i & WORD))


def column_word(j):
    """The word of key ``j``, shared by every row."""
    return mix32((j & WORD) ^ COLUMN_SALT)


def kept(key, column, threshold):
    """Whether the element of row key ``key`` and column word ``column`` is kept."""
    return mix32(key ^ column) >= threshold


def rebound(fn, compile_fn):
    """``fn`` compiled by ``compile_fn`` with its calls of :func:`mix32` bound to
    ``compile_fn(mix32)``: how a backend compiles this module's text (its own
    decorator for every function, and the calls between them resolved to the
    compiled ones, as a compiler resolves a global name)."""
    if "mix32" not in global_names(fn.__code__):
        raise LookupError(f"{fn.__qualname__} calls no mix32")
    return compile_fn(rebind(fn, {"mix32": compile_fn(mix32)}))


def seed_words(seed: int) -> tuple[int, int]:
    """A seed in ``[0, 2**64)`` as its low and high 32-bit words."""
    return seed & WORD, seed >> 32


def threshold(p: float) -> int:
    """``round(p * 2**32)``: words below it are dropped (``2**32`` drops all, at p = 1)."""
    return int(round(float(p) * 2.0**32))


def check_dropout(dropout_p, seed) -> tuple[float, int]:
    """``(p, seed)`` checked: ``0 <= p <= 1`` and, when ``p > 0``, an integer seed in
    ``[0, 2**64)`` (a NumPy integer too).  Errors name the argument."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number; got {type(dropout_p).__name__} "
                        f"{dropout_p!r}")
    p = float(dropout_p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1]; got {p}")
    if p == 0.0:
        return 0.0, 0
    if seed is None:
        raise TypeError("dropout_p > 0 needs seed=: an integer in [0, 2**64) that fixes the "
                        "keep decisions (the backward regenerates them from it)")
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an integer; got {type(seed).__name__} {seed!r}")
    seed = int(seed)
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64); got {seed}")
    return p, seed


def refuse_lazy_dropout(dropout_p) -> None:
    """Dask arrays take no dropout yet: a block would need its global offsets."""
    if dropout_p != 0.0:
        raise NotImplementedError("dropout_p > 0 with Dask arrays: not yet (each block "
                                  "would need its global offsets); compute the arrays "
                                  "first, or pass dropout_p=0.0")


def keep_scale(p: float) -> float:
    """The factor of a kept weight, ``1 / (1 - p)`` (0 at ``p = 1``: nothing is kept)."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def keep_mask(seed: int, p: float, shape, b=None, h=None, i=None, j=None) -> np.ndarray:
    """The keep decisions of a ``(B, H, Lq, Lk)`` block as a bool array (NumPy).

    ``b, h, i, j`` are the blocks' absolute indices along each axis (default
    ``arange`` of the shape).  The reference backend and the tests use it; the
    kernels evaluate the same functions element by element.
    """
    B, H, Lq, Lk = shape
    idx = [np.arange(n, dtype=np.uint64) if x is None else np.asarray(x, np.uint64)
           for x, n in ((b, B), (h, H), (i, Lq), (j, Lk))]
    bb, hh, ii, jj = np.ix_(*idx)
    lo, hi = seed_words(seed)  # Python ints: NumPy 1.26 refuses uint64 ^ int scalars
    keys = row_key(lo, hi, bb, hh, ii)
    return kept(keys, column_word(jj), np.uint64(threshold(p)))

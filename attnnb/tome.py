"""Token Merging (ToMe, Bolya et al., ICLR 2023) and its Stable Diffusion variant (tomesd).

The functions reproduce the semantics of the reference code
(facebookresearch/ToMe ``tome/merge.py`` and ``tome/utils.py``, dbolya/tomesd
``tomesd/merge.py``) on NumPy arrays, with the numerical work (similarity
matching, scatter-reduce merges, unmerges) dispatched to the ``reference``,
``cpu`` and ``cuda`` backends.  CUDA device arrays (Numba, CuPy, PyTorch:
anything with ``__cuda_array_interface__``) go to the ``cuda`` backend and
are read in place: merges, unmerges, :func:`merge_wavg` and
:func:`merge_source` then return Numba device arrays in the input's dtype;
a :class:`Matching`'s index arrays are host arrays either way.

Every matching function returns a :class:`Matching`.  It can be used as the
reference's ``merge, unmerge`` pair (``merge, unmerge = bipartite_soft_matching(...)``
unpacks it), and exposes the index arrays the reference computes.

A ToMe transformer block
------------------------
Token sizes travel with the tokens, and attention is *proportional*: a token
of size ``s`` counts as ``s`` identical keys, which is
``attnnb.attention(q, k, v, key_size=size)`` (ToMe's ``(B, N, 1)`` sizes are
accepted as they are).  The block order of the reference ``ToMeBlock`` is::

    size = None                                   # before the first block
    for layer in blocks:
        h = layer.norm1(x)
        q, k, v = heads(h)                        # (B, H, N, d) each
        att = attention(q, k, v, key_size=size)   # 1. attention with sizes
        x = x + proj(att)
        metric = k.mean(axis=1)                   # the layer's keys, mean over heads
        m = bipartite_soft_matching(metric, r_layer, class_token=True)
        x, size = merge_wavg(m, x, size)          # 2. merge, weighted by size
        x = x + mlp(layer.norm2(x))               # 3. MLP on fewer tokens

``parse_r`` turns a constant ``r`` or a schedule into the per-layer values,
and ``merge_source`` tracks which original tokens every merged token holds
(for visualisation).  ``examples/tome_vit.py`` is a runnable version.

Ties and randomness
-------------------
The reference sorts the candidate edges with ``torch.argsort(descending=True)``,
which is not stable.  Here every backend sorts stably: among equal
similarities the A token with the lower index comes first (and is merged
first); a NaN similarity ranks above every number (as ``torch.sort``) and a
protected token's ``-inf`` below every number.  ``max`` over a row takes the
first maximal B token (or the first NaN).  The random matchings draw from
``numpy.random.default_rng(seed)`` in place of ``torch.rand``/``torch.randint``:
reproducible for a seed, but not the same draws as PyTorch.

Precision: the ``reference`` backend computes similarities in float64; the
``cpu`` backend in the compute dtype (float32 for float16/float32 metrics, as
the reference code does), so on float32 data two similarities closer than
about ``1e-7`` may be ordered differently by the two backends.  Merges
accumulate in float64 and return the dtype of ``x`` (float16 in, float16 out).

Float64 ties: every backend normalises a metric row the same way, ``x /
sqrt(x_0**2 + x_1**2 + ...)`` with the squares summed channel by channel and
a true division per entry, so with one channel (a similarity is then a single
product of two unit values, exactly ``+-1``) ``reference``, ``cpu`` and
``cuda`` find the same similarities and break every tie the same way.  With
two or more channels the similarities are dot products summed in different
orders on different backends (BLAS in ``reference``, fused multiply-adds in
register-blocked tiles on ``cpu``, a multiply-add loop per thread on
``cuda``, whose compiler may also fuse the sum of squares), so two
similarities that are equal only in exact arithmetic (tokens ``a`` and
``3 a`` against the same ``b``, say) can come out one ulp apart and be taken
in a different order, or matched to a different B token, on two backends.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import numpy as np

from ._core.codes import MERGE_MODE_CODES
from ._front import dispatch as _dispatch
from ._front.checks import as_named_array
from ._front.validate import (
    check_bool,
    compute_dtypes,
    float_dtype_of,
    host_float_array,
    is_device_array,
)

__all__ = [
    "Matching",
    "bipartite_soft_matching",
    "bipartite_soft_matching_random2d",
    "kth_bipartite_soft_matching",
    "merge_source",
    "merge_wavg",
    "parse_r",
    "random_bipartite_soft_matching",
]

MODES = tuple(MERGE_MODE_CODES)  # the public names; the kernels see the codes


# ---------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------

def _int(name: str, value, minimum=None) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer; got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer; got {type(value).__name__} {value!r}") \
            from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    return value


def _device(name, x, ndim=3):
    """A device array as a Numba device array (no copy), its dtype checked."""
    from ._front.device import device_view

    arr = device_view(x, need_reshape=False)
    float_dtype_of(name, np.dtype(arr.dtype))
    if len(arr.shape) != ndim:
        raise ValueError(f"{name} must be 3-D (B, N, C); got shape {tuple(arr.shape)}")
    return arr


def _metric(metric, backend):
    """The metric as a C-contiguous ``(B, N, C)`` array in its compute dtype (a device
    array, read in place, for the ``cuda`` backend), and the backend."""
    if is_device_array(metric):
        # the backend first: a device array on a host backend is a TypeError saying so
        backend = _dispatch.choose_backend(backend, True)
        arr = _device("metric", metric)
        if arr.shape[2] == 0:
            raise ValueError(f"metric must have at least one channel; got shape "
                             f"{tuple(arr.shape)}")
        return arr, backend
    arr = host_float_array("metric", metric)
    if arr.ndim != 3:
        raise ValueError(f"metric must be 3-D (B, N, C); got shape {arr.shape}")
    if arr.shape[2] == 0:
        raise ValueError(f"metric must have at least one channel; got shape {arr.shape}")
    comp, _ = compute_dtypes(arr.dtype)
    return np.ascontiguousarray(arr, dtype=comp), _dispatch.choose_backend(backend, False)


def _rng(seed):
    """``numpy.random.default_rng(seed)``, with an error that names ``seed``."""
    try:
        return np.random.default_rng(seed)
    except (TypeError, ValueError) as exc:
        # NumPy's own message speaks of SeedSequence entropy, not of this argument
        error = TypeError if isinstance(exc, TypeError) else ValueError
        raise error(
            "seed must be None, a non-negative int (or a sequence of them), or a "
            "numpy.random.SeedSequence, BitGenerator or Generator; got "
            f"{type(seed).__name__} {seed!r}"
        ) from None


def _tokens(name, x, batch, n, why, channels="C"):
    """Check that ``x`` is a ``(batch, n, channels)`` float array; ``why`` says what for.

    A device array stays one (a Numba view, no copy).
    """
    arr = _device(name, x) if is_device_array(x) else host_float_array(name, x)
    if arr.ndim != 3:
        raise ValueError(f"{name} must be 3-D (B, N, {channels}); got shape {arr.shape}")
    if arr.shape[0] != batch or arr.shape[1] != n:
        raise ValueError(f"{name} must have shape ({batch}, {n}, {channels}) {why}; "
                         f"got {arr.shape}")
    return arr


# ---------------------------------------------------------------------------
# the matching object
# ---------------------------------------------------------------------------

class Matching:
    """Which tokens merge into which: the result of a matching function.

    Tokens are split into a source set A and a destination set B; ``r``
    tokens of A are merged into their most similar B token; the other A
    tokens stay.  After a merge the tokens are ordered
    ``[unmerged A tokens, B tokens]`` (with a distillation token, the
    reference's ``[A0, B0, A1.., B1..]``).

    Attributes
    ----------
    r : int
        Tokens removed by :meth:`merge` (after clamping; 0 for a no-op).
    n_in : int
        Tokens ``N`` of the metric (and of every ``x`` given to :meth:`merge`).
    n_out : int
        Tokens after :meth:`merge`.
    a_idx : int64 ``(B or 1, Na)``
        Positions of set A in the token sequence (``x[:, ::2]`` for the
        plain matching; 1 row when shared by the whole batch).
    b_idx : int64 ``(B or 1, Nb)``
        Positions of set B.
    unm_idx : int64 ``(B, Na - r)``
        Indices into A of the tokens that stay (their output order).
    src_idx : int64 ``(B, r)``
        Indices into A of the merged tokens, best edge first.
    dst_idx : int64 ``(B, r)``
        Index into B of the destination of each ``src_idx`` token.
    slot : int64 ``(B or 1, N)``
        The output token that input token ``p`` ends up in; ``-1`` for tokens
        dropped by :func:`kth_bipartite_soft_matching` (``N`` not a multiple
        of ``k``).
    n_kept : int
        Tokens that :meth:`unmerge` restores (``N`` except for the k-th
        matching, as the reference).

    Notes
    -----
    ``merge, unmerge = matching`` unpacks into the two bound methods, as
    the reference functions return them, and ``matching(x, mode)`` is
    ``matching.merge(x, mode)``.
    """

    def __init__(self, kind, n_in, *, a_idx, b_idx, unm_idx, src_idx, dst_idx, n_kept=None,
                 distill_token=False, backend=None, batch=1):
        self.kind = kind
        self.n_in = n_in
        self.n_kept = n_in if n_kept is None else n_kept
        self.batch = batch
        self.a_idx, self.b_idx = a_idx, b_idx
        self.unm_idx, self.src_idx, self.dst_idx = unm_idx, src_idx, dst_idx
        self.r = src_idx.shape[1]
        self.distill_token = distill_token
        self.backend = backend
        self.slot, self.n_out = self._slots()

    @classmethod
    def identity(cls, kind, batch, n, backend):
        """The reference's ``do_nothing``: every token stays where it is."""
        empty = np.zeros((batch, 0), np.int64)
        return cls(kind, n, a_idx=empty[:1], b_idx=empty[:1], unm_idx=empty, src_idx=empty,
                   dst_idx=empty, backend=backend, batch=batch)

    def _slots(self):
        if self.r == 0 and self.a_idx.shape[1] == 0:
            return np.arange(self.n_in, dtype=np.int64)[None], self.n_in
        n_unm, n_b = self.unm_idx.shape[1], self.b_idx.shape[1]
        unm_slot = np.arange(n_unm, dtype=np.int64)
        dst_slot = n_unm + np.arange(n_b, dtype=np.int64)
        if self.distill_token:  # reference order: [unm[0], dst[0], unm[1:], dst[1:]]
            unm_slot[1:] += 1
            dst_slot[0] = 1
        batch = self.unm_idx.shape[0]
        slot = np.full((batch, self.n_in), -1, np.int64)
        rows = np.arange(batch)[:, None]
        a_pos = np.broadcast_to(self.a_idx, (batch, self.a_idx.shape[1]))
        b_pos = np.broadcast_to(self.b_idx, (batch, n_b))
        slot[rows, b_pos] = dst_slot
        slot[rows, np.take_along_axis(a_pos, self.unm_idx, 1)] = unm_slot
        slot[rows, np.take_along_axis(a_pos, self.src_idx, 1)] = dst_slot[self.dst_idx]
        return slot, n_unm + n_b

    @property
    def is_identity(self) -> bool:
        return self.n_out == self.n_in and self.r == 0 and self.a_idx.shape[1] == 0

    def __iter__(self):
        return iter((self.merge, self.unmerge))

    def __call__(self, x, mode="mean"):
        return self.merge(x, mode)

    def __repr__(self):
        return (f"Matching({self.kind}, B={self.batch}, N={self.n_in} -> {self.n_out}, "
                f"r={self.r})")

    def _merge_input(self) -> str:
        """What a merge input must match, for error messages."""
        return f"to match the {self.kind} matching's metric"

    def merge(self, x, mode="mean", *, backend=None):
        """Merge the tokens of ``x`` as matched.

        Parameters
        ----------
        x : array ``(B, N, C)``
            Any per-token quantity (features, sizes, source maps).
        mode : {"mean", "sum", "amax"}
            How a destination combines with the tokens merged into it: the
            mean over the destination and its sources (the reference's
            ``scatter_reduce(include_self=True)``), their sum, or their
            maximum.
        backend : str, optional
            Defaults to the backend the matching was computed with.

        Returns
        -------
        array ``(B, n_out, C)`` in the dtype of ``x``.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
        arr = _tokens("x", x, self.batch, self.n_in, self._merge_input())
        if is_device_array(arr):  # read in place; a device result in x's dtype
            if self.is_identity:
                return _device_copy(arr)
            return _dispatch.call("tome_merge", backend or self.backend, True, arr, self.slot,
                                  self.n_out, mode)
        _, out_dtype = compute_dtypes(arr.dtype)
        if self.is_identity:
            return arr.astype(out_dtype, copy=True)
        comp, _ = compute_dtypes(arr.dtype)
        out = _dispatch.call("tome_merge", backend or self.backend, False,
                             np.ascontiguousarray(arr, dtype=comp), self.slot, self.n_out, mode)
        return out.astype(out_dtype, copy=False)

    def unmerge(self, x, *, backend=None):
        """Undo :meth:`merge`: every original token takes its merged token's value.

        Parameters
        ----------
        x : array ``(B, n_out, C)``

        Returns
        -------
        array ``(B, n_kept, C)`` in the dtype of ``x``, in the original token order.
        """
        # unmerge takes merge's output, not the metric's tokens: say so
        why = (f"for unmerge: the {self.n_out} tokens merge returns for this {self.kind} "
               f"matching of {self.n_in} tokens")
        arr = _tokens("x", x, self.batch, self.n_out, why)
        slot = np.ascontiguousarray(self.slot[:, : self.n_kept])
        if is_device_array(arr):
            if self.is_identity:
                return _device_copy(arr)
            return _dispatch.call("tome_unmerge", backend or self.backend, True, arr, slot)
        _, out_dtype = compute_dtypes(arr.dtype)
        if self.is_identity:
            return arr.astype(out_dtype, copy=True)
        comp, _ = compute_dtypes(arr.dtype)
        out = _dispatch.call("tome_unmerge", backend or self.backend, False,
                             np.ascontiguousarray(arr, dtype=comp), slot)
        return out.astype(out_dtype, copy=False)


def _device_copy(arr):
    """A fresh device copy of a device array (an identity merge returns a copy)."""
    from numba import cuda

    out = cuda.device_array(tuple(arr.shape), np.dtype(arr.dtype))
    out.copy_to_device(arr)
    return out


def _select(kind, metric, a_idx, b_idx, r, backend, *, class_token=False, distill_token=False,
            merge_all=False, n_kept=None):
    """Match set A to set B on the backend and keep the ``r`` best edges."""
    B, N, _ = metric.shape
    _, node_idx, order = _dispatch.call("tome_match", backend, is_device_array(metric), metric,
                                        a_idx, b_idx, class_token, distill_token)
    node_idx = np.asarray(node_idx, np.int64)
    if merge_all:  # every A token merges; the reference keeps A's own order
        src_idx = np.broadcast_to(np.arange(a_idx.shape[1], dtype=np.int64),
                                  (B, a_idx.shape[1])).copy()
        dst_idx = node_idx
        unm_idx = np.zeros((B, 0), np.int64)
    else:
        order = np.asarray(order, np.int64)
        src_idx = np.ascontiguousarray(order[:, :r])
        unm_idx = np.ascontiguousarray(order[:, r:])
        dst_idx = np.take_along_axis(node_idx, src_idx, axis=1)
        if class_token:  # the class token (A token 0) stays first
            unm_idx.sort(axis=1)
    return Matching(kind, N, a_idx=a_idx, b_idx=b_idx, unm_idx=unm_idx, src_idx=src_idx,
                    dst_idx=dst_idx, distill_token=distill_token, backend=backend, batch=B,
                    n_kept=n_kept)


# ---------------------------------------------------------------------------
# matching functions
# ---------------------------------------------------------------------------

def bipartite_soft_matching(metric, r, *, class_token=False, distill_token=False,
                            backend=None) -> Matching:
    """ToMe's bipartite soft matching: merge the ``r`` most similar alternating pairs.

    A = even tokens ``metric[:, ::2]``, B = odd tokens ``metric[:, 1::2]``.
    Every A token's best B partner is found by cosine similarity; the ``r``
    A tokens with the most similar partners are merged into them.

    Parameters
    ----------
    metric : array ``(B, N, C)``
        Similarity features (ToMe uses the layer's keys, averaged over heads).
    r : int
        Tokens to remove, clamped to ``(N - protected) // 2`` where
        ``protected`` counts the class and distillation tokens; ``r <= 0``
        returns a matching that changes nothing.
    class_token : bool
        Token 0 is a class token: never merged, kept first.
    distill_token : bool
        Token 1 is a distillation token: never merged into; output order
        ``[A0, B0, other unmerged A, other B]`` as the reference.
    backend : str, optional

    Returns
    -------
    Matching
        ``n_out = N - r``; ``merge`` gives ``[unmerged A tokens, B tokens]``
        (unmerged A tokens best-edge-first after the ``r`` merged ones, or in
        token order with ``class_token``).

    Notes
    -----
    Unlike the reference, :meth:`Matching.unmerge` also inverts the
    distillation token's output order (the reference's unmerge assumes the
    plain order).
    """
    metric, backend = _metric(metric, backend)
    r = _int("r", r)
    class_token = check_bool("class_token", class_token)
    distill_token = check_bool("distill_token", distill_token)
    B, N, _ = metric.shape
    protected = int(class_token) + int(distill_token)
    r = min(r, (N - protected) // 2)
    if r <= 0:
        return Matching.identity("bipartite", B, N, backend)
    a_idx = np.arange(0, N, 2, dtype=np.int64)[None]
    b_idx = np.arange(1, N, 2, dtype=np.int64)[None]
    return _select("bipartite", metric, a_idx, b_idx, r, backend, class_token=class_token,
                   distill_token=distill_token)


def kth_bipartite_soft_matching(metric, k, *, backend=None) -> Matching:
    """ToMe's k-th matching: A = all but the last token of every group of ``k``, B = the last.

    Every A token merges into its most similar B token, so ``N`` tokens
    become ``N // k``.  As in the reference, the ``N % k`` trailing tokens
    are dropped by :meth:`Matching.merge` and :meth:`Matching.unmerge`
    returns ``(N // k) * k`` tokens; ``k = 2`` merges every even token into
    an odd one.

    Parameters
    ----------
    metric : array ``(B, N, C)``
    k : int
        Group length; ``k <= 1`` returns a matching that changes nothing.
        ``k > N`` is a ValueError (no group).
    backend : str, optional
    """
    metric, backend = _metric(metric, backend)
    k = _int("k", k)
    B, N, _ = metric.shape
    if k <= 1:
        return Matching.identity("kth", B, N, backend)
    groups = N // k
    if groups == 0:
        raise ValueError(f"k must be at most the number of tokens N = {N}; got {k}")
    pos = np.arange(groups * k, dtype=np.int64).reshape(groups, k)
    a_idx = pos[:, : k - 1].reshape(1, -1)
    b_idx = pos[:, k - 1].reshape(1, -1)
    return _select("kth", metric, a_idx, b_idx, a_idx.shape[1], backend, merge_all=True,
                   n_kept=groups * k)


def random_bipartite_soft_matching(metric, r, *, seed=None, backend=None) -> Matching:
    """ToMe's random matching: ``r`` random tokens merge into the rest.

    For every batch element a random permutation of the tokens (argsort of
    uniform draws, as the reference) puts its first ``r`` tokens in A and
    the others in B; every A token merges into its most similar B token.
    :meth:`Matching.merge` returns the B tokens in that random order.

    Parameters
    ----------
    metric : array ``(B, N, C)``
    r : int
        Tokens to remove, clamped to ``N - 1`` (the reference does not clamp
        and fails there); ``r <= 0`` changes nothing.
    seed : None, int, or numpy.random.Generator
        Passed to ``numpy.random.default_rng``; anything it refuses is a
        ``TypeError`` or ``ValueError`` naming ``seed``.
    backend : str, optional
    """
    metric, backend = _metric(metric, backend)
    r = _int("r", r)
    rng = _rng(seed)  # checked even when r leaves nothing to draw
    B, N, _ = metric.shape
    r = min(r, N - 1)
    if r <= 0:
        return Matching.identity("random", B, N, backend)
    perm = np.argsort(rng.random((B, N)), axis=1, kind="stable")
    a_idx = np.ascontiguousarray(perm[:, :r])
    b_idx = np.ascontiguousarray(perm[:, r:])
    return _select("random", metric, a_idx, b_idx, r, backend, merge_all=True)


def bipartite_soft_matching_random2d(metric, w, h, sx, sy, r, *, no_rand=False, seed=None,
                                     backend=None) -> Matching:
    """tomesd's matching: one random destination per ``sy x sx`` cell of the image.

    The tokens form an ``h x w`` image (row-major).  In every full
    ``sy x sx`` cell one token (uniformly random, or the top-left one with
    ``no_rand``) is a destination (B); all other tokens, including the
    right and bottom borders when ``sx`` does not divide ``w`` or ``sy``
    does not divide ``h``, are sources (A).  The ``r`` sources most similar
    to a destination merge into it.

    Parameters
    ----------
    metric : array ``(B, N, C)`` with ``N = w * h``
    w, h : int
        Image width and height in tokens.
    sx, sy : int
        Cell width and height, ``1 <= sx <= w``, ``1 <= sy <= h``.
    r : int
        Tokens to remove, capped at the number of sources (a merging ratio
        of at most ``1 - 1 / (sx * sy)`` on a divisible image); ``r <= 0``
        changes nothing.
    no_rand : bool
        Use the top-left token of every cell (deterministic).
    seed : None, int, or numpy.random.Generator
        For ``numpy.random.default_rng`` (in place of ``torch.randint``);
        checked like any other argument, even when ``no_rand`` ignores it.
    backend : str, optional

    Returns
    -------
    Matching
        Shared by the whole batch: ``a_idx`` and ``b_idx`` have one row,
        sources and destinations each in row-major order (the reference's
        unstable argsort leaves that order unspecified).
    """
    metric, backend = _metric(metric, backend)
    w, h = _int("w", w, 1), _int("h", h, 1)
    sx, sy = _int("sx", sx, 1), _int("sy", sy, 1)
    r = _int("r", r)
    no_rand = check_bool("no_rand", no_rand)
    rng = _rng(seed)  # checked even when no_rand or r leaves nothing to draw
    B, N, _ = metric.shape
    if N != w * h:
        raise ValueError(f"metric has N = {N} tokens but w * h = {w} * {h} = {w * h}")
    if sx > w or sy > h:
        raise ValueError(f"the cell (sx, sy) = ({sx}, {sy}) must fit in the image "
                         f"(w, h) = ({w}, {h})")
    if r <= 0:
        return Matching.identity("random2d", B, N, backend)
    hsy, wsx = h // sy, w // sx
    if no_rand:
        pick = np.zeros((hsy, wsx), np.int64)
    else:
        pick = rng.integers(sy * sx, size=(hsy, wsx))
    rows = np.arange(hsy)[:, None] * sy + pick // sx
    cols = np.arange(wsx)[None, :] * sx + pick % sx
    is_dst = np.zeros((h, w), bool)
    is_dst[rows, cols] = True
    flat = is_dst.reshape(-1)
    b_idx = np.flatnonzero(flat).astype(np.int64)[None]
    a_idx = np.flatnonzero(~flat).astype(np.int64)[None]
    r = min(r, a_idx.shape[1])
    if r <= 0:  # 1 x 1 cells: every token is a destination
        return Matching.identity("random2d", B, N, backend)
    return _select("random2d", metric, a_idx, b_idx, r, backend)


# ---------------------------------------------------------------------------
# helpers of the reference
# ---------------------------------------------------------------------------

def _merge_fn(matching) -> Callable:
    if isinstance(matching, Matching):
        return matching.merge
    if callable(matching):
        return matching
    raise TypeError(f"matching must be a Matching or a merge function; "
                    f"got {type(matching).__name__}")


def merge_wavg(matching, x, size=None):
    """Merge ``x`` by the size-weighted average and track the new sizes.

    Parameters
    ----------
    matching : Matching or callable ``merge(x, mode)``
    x : array ``(B, N, C)``
    size : array ``(B, N, 1)``, optional
        How many original tokens every token stands for; ones when None.
        Integer counts are taken as ``x``'s floating dtype (as ``attention``'s
        ``key_size`` takes them); booleans are refused.

    Returns
    -------
    x : array ``(B, N', C)``
        ``sum(size * x) / sum(size)`` over every merged group.
    size : array ``(B, N', 1)``
        The summed sizes (feed to ``attention(..., key_size=size)``).
    """
    merge = _merge_fn(matching)
    if is_device_array(x):
        return _device_wavg(matching, x, size)
    x = host_float_array("x", x)
    if x.ndim != 3:
        raise ValueError(f"x must be 3-D (B, N, C); got shape {x.shape}")
    if size is None:
        size = np.ones(x.shape[:2] + (1,), x.dtype)
    else:
        size = as_named_array("size", size)
        if size.dtype.kind in "iu":  # token counts
            size = size.astype(x.dtype)
        size = host_float_array("size", size)
        if size.shape != x.shape[:2] + (1,):
            raise ValueError(f"size must have shape {x.shape[:2] + (1,)} (B, N, 1); "
                             f"got {size.shape}")
    merged = merge(x * size, mode="sum")
    size = merge(size, mode="sum")
    return merged / size, size


def _device_wavg(matching, x, size):
    """:func:`merge_wavg` of a device ``x`` (and ``size``, device or host): one kernel."""
    from numba import cuda

    if not isinstance(matching, Matching):
        raise TypeError("merge_wavg of device arrays needs a Matching, not a merge function")
    x = _tokens("x", x, matching.batch, matching.n_in, matching._merge_input())
    shape = tuple(x.shape[:2]) + (1,)
    if size is None:
        size = cuda.to_device(np.ones(shape, np.dtype(x.dtype)))
    elif is_device_array(size):
        size = _device("size", size)
    else:
        size = cuda.to_device(np.ascontiguousarray(host_float_array("size", size)))
    if tuple(size.shape) != shape:
        raise ValueError(f"size must have shape {shape} (B, N, 1); got {tuple(size.shape)}")
    backend = _dispatch.choose_backend(matching.backend, True)
    return _dispatch.call("tome_merge_wavg", backend, True, x, size, matching.slot,
                          matching.n_out)


def merge_source(matching, x, source=None):
    """Track which original tokens every current token holds.

    Parameters
    ----------
    matching : Matching or callable ``merge(x, mode)``
    x : array ``(B, N, C)``
        Only its shape is used, when ``source`` is None.
    source : array ``(B, N, N0)``, optional
        0/1 map from the current tokens to the ``N0`` original ones; the
        identity (``N0 = N``) when None.

    Returns
    -------
    array ``(B, N', N0)``: ``source`` merged with ``mode="amax"``.
    """
    merge = _merge_fn(matching)
    if source is None and is_device_array(x):  # the identity map, copied to the device
        from numba import cuda

        x = _device("x", x)
        n, t = x.shape[:2]
        source = cuda.to_device(np.ascontiguousarray(
            np.broadcast_to(np.eye(t, dtype=np.dtype(x.dtype)), (n, t, t))))
    elif source is None:
        x = host_float_array("x", x)
        if x.ndim != 3:
            raise ValueError(f"x must be 3-D (B, N, C); got shape {x.shape}")
        n, t = x.shape[:2]
        source = np.broadcast_to(np.eye(t, dtype=x.dtype), (n, t, t))
    elif isinstance(matching, Matching):
        # checked here, as merge would name its own argument x
        source = _tokens("source", source, matching.batch, matching.n_in,
                         matching._merge_input(), channels="N0")
    return merge(source, mode="amax")


def parse_r(num_layers, r):
    """The number of tokens to merge in every layer, as ToMe's ``parse_r``.

    Parameters
    ----------
    num_layers : int, >= 1
    r : int, list of int, or tuple ``(r, inflect)``
        * int: the same ``r`` in every layer;
        * list: per-layer values, padded with zeros to ``num_layers``
          (a longer list is returned whole, as the reference);
        * ``(r, inflect)``: a linear schedule from ``int(r * (1 - inflect))``
          to ``2 r - int(r * (1 - inflect))``; ``inflect = -1`` is the
          paper's decreasing schedule, 0 constant, +1 increasing.

    Returns
    -------
    list of int, ``int(min + step * i)`` for every layer ``i``.  With one
    layer the schedule is its first value (the reference divides by zero).
    """
    num_layers = _int("num_layers", num_layers, 1)
    if isinstance(r, list):
        values = [_int(f"r[{i}]", v) for i, v in enumerate(r)]
        return values + [0] * (num_layers - len(values))
    inflect = 0.0
    if isinstance(r, tuple):
        if len(r) != 2:
            raise ValueError(f"r as a tuple must be (r, inflect); got {r!r}")
        r, inflect = r
        inflect = float(inflect)
    r = _int("r", r)
    min_val = int(r * (1.0 - inflect))
    max_val = 2 * r - min_val
    step = (max_val - min_val) / (num_layers - 1) if num_layers > 1 else 0.0
    return [int(min_val + step * i) for i in range(num_layers)]

"""How the SDPA drop-in reads PyTorch's arguments: shapes, masks, causal alignment, errors.

:func:`attnnb.torch.scaled_dot_product_attention` promises PyTorch's
behaviour (torch 2.13, ``torch.nn.functional.scaled_dot_product_attention``),
which differs from attnnb's own functions in four ways, all settled here so
that the drop-in itself only calls :func:`attnnb.torch.attention`:

* **Broadcasting.**  Every axis before the last two broadcasts between
  query, key and value (batch axes and the head axis).  A key/value head axis
  of 1 stays 1 (attnnb reads it for every query head, as grouped-query
  attention with one group: no copy); other broadcasts are views that the
  kernels copy once.  With ``enable_gqa`` the head counts follow PyTorch's
  rule instead (``Hq`` a multiple of ``Hk``; batch axes still broadcast).
* **Causal alignment.**  ``is_causal`` and ``CausalBias`` upper-left mean
  ``j <= i`` (top-left); attnnb's ``causal`` is bottom-right
  (``j <= i + S - L``).  Top-left is mapped onto the kernels' own limit
  without a mask: with ``L <= S`` no query sees a key past ``L - 1``, so the
  keys are cut to ``L`` and the square is causal; with ``L > S`` the first
  ``S`` rows are a causal square and the rest see every key (two calls).
  ``CausalBias`` lower-right is attnnb's ``causal`` as it is.
* **Masks.**  ``attn_mask`` is a bool tensor (True = attend), a float tensor
  of float32 or the query's dtype (added to the logits), or a
  ``CausalBias``; any other dtype, a sparse layout or a tensor subclass is
  refused (a subclass's storage need not hold its values: never read).
* **Dropout.**  ``dropout_p`` runs in the kernels (:mod:`attnnb._core.dropout`),
  its seed drawn from PyTorch's default generator; zero in eval mode is the
  caller's choice, as in PyTorch.  The decisions are keyed by the whole
  call's rows and keys, so top-left causal with ``L > S`` then runs as one
  call with a mask (:func:`as_one_mask`).
* **Exceptions.**  Where PyTorch raises ``RuntimeError``, the drop-in raises
  :class:`SDPAError`, an instance of both ``RuntimeError`` and ``ValueError``
  (what attnnb raised before), or :class:`SDPATypeError` (``TypeError`` and
  ``RuntimeError``) for a dtype or type.  Code written against either keeps
  working.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.bias import CausalBias, CausalVariant


class SDPAError(RuntimeError, ValueError):
    """An argument PyTorch's SDPA refuses with ``RuntimeError`` (attnnb raised ``ValueError``)."""


class SDPATypeError(TypeError, RuntimeError):
    """A dtype or type PyTorch's SDPA refuses with ``RuntimeError``."""


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


@dataclass(frozen=True)
class Segment:
    """One attnnb call of the drop-in: query rows ``[row_start, row_stop)`` against keys
    ``[0, key_stop)``, bottom-right ``causal`` or not."""

    row_start: int
    row_stop: int
    key_stop: int
    causal: bool


def top_left_causal(L: int, S: int) -> list[Segment]:
    """Query ``i`` sees keys ``j <= i`` (PyTorch's ``is_causal``), as bottom-right calls.

    Parameters
    ----------
    L, S : int
        Query and key lengths.

    Returns
    -------
    list of Segment
        One segment when ``L <= S`` (the keys cut to ``L``), two when ``L > S``
        (a causal ``S x S`` square, then ``L - S`` rows that see every key).
    """
    if L <= S:
        return [Segment(0, L, L, True)]
    segments = [Segment(0, S, S, True)] if S > 0 else []
    return segments + [Segment(S, L, S, False)]


def _check_plain(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise SDPATypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if type(x) not in _PLAIN_TENSORS:
        raise SDPATypeError(f"{name} is a {type(x).__module__}.{type(x).__name__}, a tensor "
                            "subclass the drop-in does not understand (its storage need not "
                            "hold its values); pass a plain torch.Tensor")
    if x.layout != torch.strided:
        raise SDPATypeError(f"{name} must be a dense (strided) tensor; got layout {x.layout}")


def check_qkv(query, key, value, dropout_p) -> None:
    """PyTorch's refusals of query, key, value and dropout_p, with its exception types."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        _check_plain(name, x)
        if x.dim() < 2:
            raise SDPAError(f"{name} must have at least 2 dimensions (L, E); got shape "
                            f"{tuple(x.shape)}")
    if not (query.dtype == key.dtype == value.dtype):
        raise SDPAError("Expected query, key, and value to have the same dtype (query, key "
                        f"and value must have one dtype); got {query.dtype}, {key.dtype} and "
                        f"{value.dtype}")
    if not query.is_floating_point():
        raise SDPATypeError(f"query, key and value must be floating tensors; got {query.dtype}")
    if not 0.0 <= float(dropout_p) <= 1.0:
        raise SDPAError(f"dropout probability has to be between 0 and 1, but got {dropout_p}")


def broadcast_qkv(query, key, value, enable_gqa: bool):
    """query, key and value with their leading axes broadcast as PyTorch broadcasts them.

    Returns views of equal rank.  A key/value head axis of 1 is kept (attnnb
    reads one key head for every query head); ``enable_gqa`` asks for
    ``Hq % Hk == 0`` with ``Hk == Hv``.
    """
    shapes = [tuple(x.shape) for x in (query, key, value)]
    if key.shape[-2] != value.shape[-2]:
        raise SDPAError(f"key and value must have the same length; got key {shapes[1]} and "
                        f"value {shapes[2]}")
    gqa = enable_gqa and min(x.dim() for x in (query, key, value)) >= 3
    try:
        if gqa:
            Hq, Hk, Hv = query.shape[-3], key.shape[-3], value.shape[-3]
            if Hk != Hv or Hq % Hk:
                raise SDPAError("Number of heads in key and value must divide the number of "
                                f"heads in query (enable_gqa); got query {Hq}, key {Hk} and "
                                f"value {Hv} heads")
            batch = torch.broadcast_shapes(*(s[:-3] for s in shapes))
            q_lead, kv_lead = batch + (Hq,), batch + (Hk,)
        else:
            kv_lead = torch.broadcast_shapes(shapes[1][:-2], shapes[2][:-2])
            q_lead = torch.broadcast_shapes(shapes[0][:-2], kv_lead)
            shared_head = len(kv_lead) >= 1 and len(q_lead) >= 1 and kv_lead[-1] == 1
            kv_lead = q_lead[:-1] + (1,) if shared_head else q_lead
    except RuntimeError as exc:
        if isinstance(exc, SDPAError):
            raise
        raise SDPAError(f"query {shapes[0]}, key {shapes[1]} and value {shapes[2]} do not "
                        f"broadcast against each other before their last two axes: {exc}"
                        ) from exc
    return (query.expand(*q_lead, *shapes[0][-2:]), key.expand(*kv_lead, *shapes[1][-2:]),
            value.expand(*kv_lead, *shapes[2][-2:]))


@dataclass(frozen=True)
class MaskPlan:
    """What ``attn_mask`` and ``is_causal`` ask of attnnb: the segments
    (:class:`Segment`), and a bool ``mask`` or float ``bias`` (only with one
    segment of all rows and keys)."""

    mask: torch.Tensor | None
    bias: torch.Tensor | None
    segments: list


def mask_plan(attn_mask, is_causal: bool, query, key) -> MaskPlan:
    """Read ``attn_mask`` and ``is_causal`` as PyTorch does; refuse what it refuses.

    ``query`` and ``key`` are the broadcast tensors (:func:`broadcast_qkv`).
    """
    L, S = query.shape[-2], key.shape[-2]
    whole = [Segment(0, L, S, False)]
    if attn_mask is None:
        return MaskPlan(None, None, top_left_causal(L, S) if is_causal else whole)
    if isinstance(attn_mask, CausalBias):
        if is_causal:  # PyTorch's CausalBias raises ValueError here
            raise SDPAError("CausalBias should not be used with is_causal=True")
        if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (L, S):
            raise SDPAError(f"attn_mask is a CausalBias for {attn_mask.seq_len_q} queries and "
                            f"{attn_mask.seq_len_kv} keys; query and key have {L} and {S}")
        if attn_mask.variant == CausalVariant.LOWER_RIGHT:
            return MaskPlan(None, None, [Segment(0, L, S, True)])
        if attn_mask.variant == CausalVariant.UPPER_LEFT:
            return MaskPlan(None, None, top_left_causal(L, S))
        raise SDPATypeError(f"attn_mask is a CausalBias of variant {attn_mask.variant!r}, "
                            "which the drop-in does not know")
    if is_causal:
        raise SDPAError("_scaled_dot_product_attention: Explicit attn_mask should not be set "
                        "when is_causal=True (attn_mask and is_causal cannot both be set)")
    _check_plain("attn_mask", attn_mask)
    if attn_mask.device != query.device:
        raise SDPAError(f"attn_mask must be on the device of query ({query.device}); got "
                        f"{attn_mask.device}")
    dtype = attn_mask.dtype
    if dtype not in (torch.bool, torch.float32, query.dtype):
        raise SDPATypeError("Expected attn_mask dtype to be bool or float or to match query "
                            f"dtype, but got attn_mask.dtype: {dtype} and query.dtype: "
                            f"{query.dtype}")
    out_shape = (*query.shape[:-1], S)
    try:
        fits = torch.broadcast_shapes(tuple(attn_mask.shape), out_shape) == out_shape
    except RuntimeError:
        fits = False
    if not fits:
        raise SDPAError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                        f"the attention weights' shape {out_shape}")
    if dtype == torch.bool:
        return MaskPlan(attn_mask, None, whole)
    return MaskPlan(None, attn_mask, whole)


def as_one_mask(plan: MaskPlan, query, key) -> MaskPlan:
    """``plan``'s segments (no mask of their own) as one call with a bool mask: dropout's
    decisions are keyed by the rows and keys of the whole call, which a split would
    renumber."""
    L, S = query.shape[-2], key.shape[-2]
    allowed = torch.zeros(L, S, dtype=torch.bool, device=query.device)
    for seg in plan.segments:
        rows = allowed[seg.row_start:seg.row_stop, :seg.key_stop]
        if seg.causal:
            diag = seg.key_stop - (seg.row_stop - seg.row_start)
            rows |= torch.ones_like(rows).tril(diag)
        else:
            rows |= True
    return MaskPlan(allowed, None, [Segment(0, L, S, False)])

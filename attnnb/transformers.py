"""HuggingFace ``transformers`` backend: ``attn_implementation="attnnb"`` in one call.

``import attnnb.transformers`` (it imports ``transformers``, an optional
extra that ``import attnnb`` never loads) and call :func:`register`; then
any model written against transformers' ``AttentionInterface`` runs its
attention on attnnb's kernels::

    import attnnb.transformers
    attnnb.transformers.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="attnnb")
    model.set_attn_implementation("attnnb")    # or switch an existing model

:func:`register` adds two functions under the name ``"attnnb"``:

* :func:`attention_forward` to ``transformers.AttentionInterface``: what the
  models' attention layers call.  It hands query, key and value to
  :func:`attnnb.torch.scaled_dot_product_attention`, the drop-in for
  PyTorch's SDPA, so gradients flow through attnnb's backward.
* :func:`attention_mask` to ``transformers.masking_utils.AttentionMaskInterface``:
  what the models call to build their masks.  Without an entry there,
  transformers builds no mask at all for a custom attention function (the
  causal and padding masks would be silently lost).

Choices made
------------
* **Masks.**  The masks are those transformers builds for ``"sdpa"``: None
  where the mask is purely causal (no padding, no window that binds) or
  purely bidirectional, so that attnnb applies its own causal limit with no
  mask to read; a boolean ``(batch, 1, q_len, kv_len)`` mask (True = attend)
  otherwise, padding, sliding window, chunks and packed sequences included.
* **Causal.**  With no mask, the attention is causal when the caller's
  ``is_causal`` (else the module's ``is_causal`` attribute, else True) says
  so and there is more than one query: a single query (decoding with a
  cache) sees every cached key.  Causal is top-left, as in PyTorch's SDPA,
  which is also right when the keys outnumber the queries in a prefill
  (a static cache's empty slots are cut off).  This is the rule of
  transformers' own ``sdpa_attention_forward``.
* **Grouped-query attention.**  When the keys have fewer heads than the
  queries, the drop-in is called with ``enable_gqa=True``: each key head
  serves its group of query heads without copies of keys and values.
* **Relative position bias** (``position_bias``, T5 and its family): added
  to the logits as a float mask; where the boolean (or causal) mask says no,
  the bias is replaced by the dtype's most negative number, as in
  ``sdpa_attention_forward``.  The bias gets a gradient.
* **Sliding window** (``sliding_window``, Mistral, Gemma 2, ...): run as
  :func:`attnnb.mods.sliding_window`, no mask built, where the layer's mask
  would be the window and the causal limit alone: :func:`attention_mask`
  recognises transformers' own sliding-window causal mask function (its
  structure, exactly; anything else is built as for ``"sdpa"``) with no
  padding and the queries the last positions of the keys, and returns None;
  :func:`attention_forward` then applies the layer's ``sliding_window``
  (bottom-right aligned, also for one query decoding with a cache).  A
  mask that is built carries the window itself.
* **Attention sinks** (``s_aux``, gpt-oss: a learned logit per head in the
  softmax's denominator only): the drop-in's ``sinks``, with a gradient
  (docs/contract.md §1.15).
* **Logit soft-capping** (``softcap``, Gemma 2): ``cap * tanh(s / cap)`` of
  the scaled logits before the mask, as :func:`attnnb.mods.softcap` (a score
  function compiled into the kernels; no mask or bias is built for it).
* **Refused** with ``NotImplementedError``, naming the argument: ``indices``
  and ``block_indices`` (sparse attention chosen by an indexer, DeepSeek-V3.2
  and MiniMax): they change the result and attnnb does not compute them
  yet.
* **Ignored**, as they do not change the result here: ``position_ids``,
  ``cu_seq_lens_q``, ``cu_seq_lens_k``, ``max_length_q``, ``max_length_k``
  and ``seq_idx`` (packed sequences reach this function through the mask,
  which transformers builds from ``position_ids``, as for ``"sdpa"``),
  ``deterministic`` (a flash-attention switch; attnnb's kernels give
  bit-identical results from run to run),
  ``kernel_options`` (flex attention's), ``use_cache``, ``cache_position``,
  ``num_items_in_batch``, ``output_hidden_states``, ``output_router_logits``.
  ``output_attentions=True`` warns: the attention weights are never formed,
  and None is returned in their place.  Any other keyword that is not None
  warns once per name, as it may change the result of a model this module
  does not know.
* **Dropout.**  ``dropout`` (the model's attention dropout in training
  mode, 0.0 in eval mode) is passed on to the drop-in as ``dropout_p``:
  attnnb's kernels drop the weights (docs/contract.md §1.14), with a seed
  drawn from PyTorch's generator, so ``torch.manual_seed`` reproduces a
  training step.
"""

from __future__ import annotations

import inspect
import threading
import warnings

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from . import mods
from . import torch as _attnnb_torch

__all__ = ["NAME", "attention_forward", "attention_mask", "register"]

NAME = "attnnb"

# Keywords that models pass and whose result attnnb cannot produce yet: name -> what it is.
_REFUSED = {
    "indices": "sparse attention over indexer-selected keys",
    "block_indices": "sparse attention over indexer-selected key blocks",
}

# Keywords that reach attention functions without changing what they compute here.
_IGNORED = frozenset({
    "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
    "deterministic", "kernel_options", "use_cache", "cache_position", "num_items_in_batch",
    "output_hidden_states", "output_router_logits",
})

_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(key: str, message: str) -> None:
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, UserWarning, stacklevel=4)  # blame the model's attention layer


def _check_kwargs(module: torch.nn.Module, kwargs: dict) -> None:
    """Refuse the keywords that attnnb cannot honour; warn about unknown ones."""
    model = type(module).__name__
    for name, value in kwargs.items():
        if value is None or name in _IGNORED:
            continue
        if name in _REFUSED:
            shown = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                     else repr(value))
            raise NotImplementedError(
                f"attnnb has no {_REFUSED[name]} yet: {model} passes {name}={shown}; use "
                "attn_implementation='eager' for this model")
        if name == "output_attentions":
            if value:
                _warn_once(name, "attn_implementation='attnnb' does not form the attention "
                                 "weights: output_attentions=True gives None in their place")
            continue
        _warn_once(name, f"attn_implementation='attnnb' ignores the keyword {name!r} that "
                         f"{model} passes; check that it does not change the attention")


def _bias_mask(position_bias: torch.Tensor, mask: torch.Tensor | None, causal: bool,
               query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``position_bias`` and the mask (or top-left causal limit) as one additive float mask."""
    if mask is not None and mask.dtype != torch.bool:
        return position_bias + mask  # both additive
    if mask is None and causal:
        q_len, kv_len = query.shape[-2], key.shape[-2]
        rows = torch.arange(q_len, device=key.device)[:, None]
        mask = rows >= torch.arange(kv_len, device=key.device)[None, :]
    if mask is None:
        return position_bias
    # the fill must be representable in both dtypes (a float32 bias under autocast)
    fill = max(torch.finfo(query.dtype).min, torch.finfo(position_bias.dtype).min)
    return torch.where(mask, position_bias, fill)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, position_bias: torch.Tensor | None = None,
                      s_aux: torch.Tensor | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """The attention of one layer, as transformers' ``AttentionInterface`` calls it.

    Parameters
    ----------
    module : torch.nn.Module
        The calling attention layer; its ``is_causal`` attribute is read when
        ``is_causal`` is None.
    query : torch.Tensor
        ``(batch, heads, q_len, head_dim)``.
    key, value : torch.Tensor
        ``(batch, kv_heads, kv_len, head_dim)`` and ``(..., v_dim)``;
        ``heads`` a multiple of ``kv_heads`` (grouped-query attention, no
        copy of key and value).
    attention_mask : torch.Tensor or None
        From :func:`attention_mask` (None, or boolean with True = attend), or
        a 4D mask the user passed to the model (boolean, or float added to
        the logits); broadcast to ``(batch, heads, q_len, kv_len)``.
    dropout : float, default 0.0
        Probability of dropping an attention weight, passed on as the
        drop-in's ``dropout_p``.
    scaling : float, optional
        Factor of the logits; None means ``1 / sqrt(head_dim)``.
    is_causal : bool, optional
        Whether the layer is causal; None reads ``module.is_causal`` (True
        when the module has none).  Applied (top-left) only with no mask and
        more than one query, as in transformers' SDPA integration.
    position_bias : torch.Tensor, optional
        Added to the logits (T5's relative position bias), with a gradient.
    s_aux : torch.Tensor, optional
        ``(heads,)`` learned attention sinks (gpt-oss; ``sinks`` is read as the
        same), with a gradient.
    **kwargs
        ``softcap`` soft-caps the logits; ``sliding_window`` (a causal layer's
        window) is applied as a mask function when there is no mask (module
        notes); ``indices`` and ``block_indices`` raise ``NotImplementedError``
        when not None; the others are listed in the module docstring.

    Returns
    -------
    attn_output : torch.Tensor
        ``(batch, q_len, heads, v_dim)``, contiguous, in the query's dtype.
    attn_weights : None
        The weights are never formed.

    Raises
    ------
    NotImplementedError
        A keyword that changes the attention in a way attnnb cannot compute.
    RuntimeError
        From the drop-in: ``dropout`` outside ``[0, 1]``, and PyTorch's other
        refusals.
    """
    if s_aux is None:  # the same sinks under the name some models use
        s_aux = kwargs.pop("sinks", None)
    softcap = kwargs.pop("softcap", None)
    window = kwargs.pop("sliding_window", None)
    _check_kwargs(module, kwargs)
    q_len = query.shape[-2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    # a mask carries causality itself; one query sees every key in the cache
    causal = bool(is_causal) and attention_mask is None and q_len > 1
    mask_mod = None
    if window is not None and bool(is_causal) and attention_mask is None:
        # the window holds the causal limit, bottom-right as the cache's queries sit
        mask_mod, causal = mods.sliding_window(int(window)), False
    mask = attention_mask
    if position_bias is not None:
        mask = _bias_mask(position_bias, attention_mask, causal, query, key)
        causal = False
    out = _attnnb_torch.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scaling,
        enable_gqa=key.shape[-3] != query.shape[-3], sinks=s_aux, mask_mod=mask_mod,
        score_mod=None if softcap is None else mods.softcap(float(softcap)))
    return out.transpose(1, 2).contiguous(), None


def attention_mask(*args, **kwargs) -> torch.Tensor | None:
    """The mask of a model layer, as transformers' ``AttentionMaskInterface`` asks for it.

    The mask transformers builds for ``"sdpa"``
    (``transformers.masking_utils.sdpa_mask``, same arguments): None when
    the attention is purely causal with no padding and no binding window
    (:func:`attention_forward` then applies attnnb's causal limit, or none
    for a single query) or purely bidirectional with no padding, and None
    for a sliding-window causal layer with no padding whose queries are the
    last positions of its keys (:func:`attention_forward` applies the
    window as a mask function); else a boolean ``(batch, 1, q_len, kv_len)``
    tensor, True where a query attends to a key, with padding, sliding
    window, chunks and packed sequences in it.

    Returns
    -------
    torch.Tensor or None
    """
    if _window_only(args, kwargs):
        return None
    return sdpa_mask(*args, **kwargs)


def _window_only(args, kwargs) -> bool:
    """Whether the mask asked for is transformers' sliding window and causal limit alone,
    with no padding, and the queries the last ``q_length`` positions of the keys (so that
    the bottom-right :func:`attnnb.mods.sliding_window` is that mask)."""
    try:
        given = inspect.signature(sdpa_mask).bind(*args, **kwargs).arguments
    except TypeError:
        return False
    if _window_of(given.get("mask_function")) is None or not given.get(
            "allow_is_causal_skip", True):
        return False
    q_offset, kv_offset = given.get("q_offset", 0), given.get("kv_offset", 0)
    if not all(isinstance(x, int) for x in (q_offset, kv_offset)):
        return False  # a static cache's offsets are tensors
    q_length, kv_length = given["q_length"], given["kv_length"]
    if q_offset + q_length != kv_offset + kv_length:
        return False
    padding = given.get("attention_mask")
    return padding is None or bool(padding.all())


def _window_of(mask_function) -> int | None:
    """The window of transformers' ``sliding_window_causal_mask_function(w)`` (an
    ``and_masks`` of ``sliding_window_overlay(w)`` and ``causal_mask_function``), else
    None: recognised by structure, so any other function is built as it is."""
    if getattr(mask_function, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    parts = inspect.getclosurevars(mask_function).nonlocals.get("mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2 or parts[1] is not causal_mask_function:
        return None
    overlay = parts[0]
    if getattr(overlay, "__qualname__", "") != "sliding_window_overlay.<locals>.inner_mask":
        return None
    window = inspect.getclosurevars(overlay).nonlocals.get("sliding_window")
    return window if isinstance(window, int) and window >= 1 else None


def register() -> None:
    """Make ``attn_implementation="attnnb"`` available to every transformers model.

    Registers :func:`attention_forward` in ``transformers.AttentionInterface``
    and :func:`attention_mask` in
    ``transformers.masking_utils.AttentionMaskInterface``, both under the
    name ``"attnnb"`` and for all models.  Calling it again changes nothing.

    Returns
    -------
    None

    Examples
    --------
    >>> import attnnb.transformers
    >>> attnnb.transformers.register()
    >>> from transformers import AutoModelForCausalLM, LlamaConfig
    >>> config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                      num_attention_heads=4, num_key_value_heads=2, vocab_size=50)
    >>> model = AutoModelForCausalLM.from_config(config, attn_implementation="attnnb")
    >>> model.config._attn_implementation
    'attnnb'
    """
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, attention_mask)

"""attnnb.torch's calls with mask or score functions (:mod:`attnnb.mods`).

A mod is a Python object, which an operator schema cannot carry, so these
calls do not go through the ``attnnb::`` operators: a
``torch.autograd.Function`` runs :func:`attnnb.vjp` on NumPy views of the
CPU tensors and keeps its pullback for the backward.  Gradients reach
``q``, ``k``, ``v``, ``bias``, ``key_size``, ``sinks``, ``lam`` and every floating
torch tensor among the score function's parameters (the arrays given to
:func:`attnnb.mods.score_mod` or a built-in: ALiBi's slopes, T5's table, the
forgetting gates).  ``torch.compile`` breaks the graph at such a call.
"""

from __future__ import annotations

import numpy as np
import torch

from .._mods.core import detached, parameters
from ..vjp import vjp

_GRADIENTS = ("q", "k", "v", "bias", "key_size", "sinks", "lam")
_POSITIONAL = ("q", "k", "v", "lam")  # (``positional`` hands them to the function)


def _tensor(x):
    return torch.from_numpy(np.ascontiguousarray(x))


def _numpy(t):
    return t.detach().numpy() if isinstance(t, torch.Tensor) else t


class _ModCall(torch.autograd.Function):
    """``forward(ctx, call, *tensors)``: ``call`` says what the tensors are."""

    @staticmethod
    def forward(ctx, call, *tensors):
        named = dict(zip(call["names"], tensors[:len(call["names"])]))
        arrays = {n: _numpy(t) for n, t in named.items()}
        result, pullback = vjp(call["function"], *call["positional"](arrays), **{
            n: a for n, a in arrays.items() if n not in _POSITIONAL}, **call["static"])
        ctx.pullback = pullback
        ctx.call = call
        return tuple(_tensor(x) for x in result) if call["lse"] else _tensor(result)

    @staticmethod
    def backward(ctx, dout, dlse=None):
        call = ctx.call
        dout = np.zeros(dout.shape) if dout is None else dout.numpy()
        grads = (ctx.pullback(dout, None if dlse is None else dlse.numpy()) if call["lse"]
                 else ctx.pullback(dout))
        result = [None]  # for ``call``
        for name in call["names"]:
            g = grads.get(name) if name in _GRADIENTS else None
            result.append(None if g is None else torch.from_numpy(np.ascontiguousarray(g)))
        mod_grads = grads.get("score_mod") or ()
        for index in call["param_index"]:
            g = mod_grads[index] if index < len(mod_grads) else None
            result.append(None if g is None else torch.from_numpy(np.ascontiguousarray(g)))
        return tuple(result)


def call(function, positional, named: dict, static: dict, score_mod, lse: bool = True):
    """``function`` (an attnnb NumPy function) on tensors with mods, differentiable.

    Parameters
    ----------
    function : callable
        :func:`attnnb.attention`, :func:`attnnb.sparse_attention`,
        :func:`attnnb.topk_attention` or (``lse=False``) :func:`attnnb.diff_attention`.
    positional : callable
        ``positional(arrays) -> tuple``: its positional arguments from the NumPy
        arrays by name (``q, k, v`` and, for sparse attention, the pattern).
    named : dict
        The tensor arguments by name (``q``, ``k``, ``v``, ``bias``, ...;
        None for those not given), CPU tensors.
    static : dict
        The other keyword arguments, ``mask_mod`` and ``score_mod`` among them.
    score_mod : :class:`attnnb.mods.ScoreMod` or None
        Its floating torch-tensor parameters join the differentiable inputs.
    lse : bool
        Whether ``function`` has an LSE (every one but differential attention).

    Returns
    -------
    ``(out, lse)``, tensors in the compute dtype; ``out`` alone without ``lse``.
    """
    given = {n: t for n, t in named.items() if t is not None}
    for name, t in given.items():
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            raise NotImplementedError(f"mask_mod and score_mod on {t.device} tensors ({name}): "
                                      "not yet (the cpu and reference backends have them)")
    params = parameters(score_mod) if score_mod is not None else []
    static = dict(static, score_mod=detached(score_mod))
    index = [n for n, p in enumerate(params)
             if isinstance(p, torch.Tensor) and p.is_floating_point()]
    inputs = [*given.values(), *(params[n] for n in index)]
    if not (torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)):
        arrays = {n: _numpy(t) for n, t in given.items()}
        result = function(*positional(arrays), **{
            n: a for n, a in arrays.items() if n not in _POSITIONAL}, **static)
        return tuple(_tensor(x) for x in result) if lse else _tensor(result)
    spec = {"function": function, "positional": positional, "names": tuple(given),
            "static": static, "param_index": index, "lse": lse}
    return _ModCall.apply(spec, *inputs)

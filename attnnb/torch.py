"""PyTorch bridge: attnnb's four functions as differentiable ``torch`` operators.

``import attnnb.torch`` (extra ``attnnb[torch]``) registers eight operators
in the ``attnnb`` namespace of ``torch.library`` (a forward and a backward
for each of :func:`attention`, :func:`sparse_attention`,
:func:`topk_attention` and :func:`diff_attention`) and defines the four
functions on ``torch.Tensor``\\ s, with the arguments of the NumPy API
(docs/contract.md §2, §6), plus :func:`scaled_dot_product_attention`, a
drop-in for PyTorch's.

What they do with tensors
-------------------------
* **CPU tensors** reach the kernels as NumPy views of the tensors' memory:
  no copy of float32 or float64 inputs.  A non-contiguous input costs what
  it costs in the NumPy API: the kernels take one contiguous copy of it.
  float16 and bfloat16 inputs are cast to float32 (a copy) before the
  operator and its result cast back, as torch's own CPU kernels compute
  them; LSEs stay float32.
* **CUDA tensors** reach the ``cuda`` backend through
  ``__cuda_array_interface__`` (no copy).  The backend launches on Numba's
  default stream, so the bridge waits for torch's current stream before
  the launch and for the device after it: correct with any stream, at the
  price of two synchronisations per call.  No GPU was available to test
  this path; the tests that need one skip.
* **Autograd**: gradients flow into every floating tensor argument that
  requires grad: ``q``, ``k``, ``v``, ``bias``, ``key_size``, ``lam``,
  ``sinks`` (``mask`` and patterns are constants).  The backward operator uses the
  forward's saved ``out`` and ``lse`` (the forward is not run again; the
  differential forward keeps no LSE and its backward recomputes the two
  streams', as :func:`attnnb.vjp` does).  Cotangents of outputs that were
  not used arrive as None and cost nothing.
* **Backend.** ``backend=None`` is resolved when the function is called
  (:func:`attnnb.use_backend` of the calling thread, then ``ATTNNB_BACKEND``,
  then ``"auto"``; under ``torch.compile``, when it is traced) and the backward
  runs on the same backend, as :func:`attnnb.vjp`'s pullback does.
* **Dropout** (``dropout_p > 0``): the seed is an operator argument, drawn
  from PyTorch's default generator when not given; under ``torch.compile``
  that draw (an ``.item()``) breaks the graph, so pass ``seed=`` there.
* **torch.compile** sees each call as one operator (fake-tensor rules are
  registered, so it traces without running the kernels and without a graph
  break), and ``torch.library.opcheck`` passes on all eight.

**Threads.** PyTorch's OpenMP threads keep spinning after each operator
and slow the attnnb call that follows.  When ``attnnb.torch`` is imported
before torch, it sets ``OMP_WAIT_POLICY=PASSIVE`` (unless the variable is
already set) so that they sleep instead; when torch was imported first the
policy is already fixed, and setting ``OMP_WAIT_POLICY=PASSIVE`` in the
environment (or importing ``attnnb.torch`` first) gives the same.

Patterns cross the operator boundary as their CSR arrays (``indptr``,
``indices``, ``n_heads``) and are rebuilt inside it, checked again (a cost
of O(allowed pairs) integer work per call, small next to the attention).
"""

from __future__ import annotations

import contextlib
import numbers
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

if "torch" not in sys.modules:
    # PyTorch's OpenMP threads spin after each operator by default and take the cores
    # from the kernels' threads that start next (docs/notes/performance.md, "Inside a PyTorch
    # program").  libgomp reads the policy once, when torch loads it, so it can only be
    # chosen before `import torch`; a value the user set is kept.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ._bridges import common as _bridge
from ._bridges import torch_sdpa as _sdpa  # noqa: E402
from ._core.dropout import check_dropout  # noqa: E402
from ._front import dispatch as _dispatch  # noqa: E402
from ._front.validate import check_bool  # noqa: E402
from .attention import attention as _np_attention  # noqa: E402
from .diff import diff_attention as _np_diff_attention  # noqa: E402
from .patterns import Pattern  # noqa: E402
from .sparse import sparse_attention as _np_sparse_attention  # noqa: E402
from .sparse import topk_attention as _np_topk_attention  # noqa: E402

__all__ = ["attention", "diff_attention", "scaled_dot_product_attention", "sparse_attention",
           "topk_attention"]

_NAMESPACE = "attnnb"
_DIFFERENTIABLE = ("q", "k", "v", "bias", "key_size", "lam", "sinks", "sigmoid_bias_heads")
# An operator input whose gradient the bridge returns under another name: a learned
# sigmoid bias is a tensor input of its own beside the constant's ``float?``.
_GRADIENT_OF = {"sigmoid_bias_heads": "sigmoid_bias"}


# ---------------------------------------------------------------------------
# tensors to arrays and back


def _array(t: torch.Tensor | None):
    """A NumPy view of a CPU tensor, the tensor itself on CUDA (``__cuda_array_interface__``)."""
    if t is None:
        return None
    t = t.detach()
    if t.device.type == "cpu":
        return t.numpy()
    return t


def _tensor(a, device: torch.device) -> torch.Tensor:
    """A result array as a contiguous tensor on ``device`` (sharing NumPy's memory)."""
    if isinstance(a, np.ndarray):
        if not a.flags.writeable:  # torch warns on read-only memory; results are few and small
            a = a.copy()
        return torch.from_numpy(a).contiguous()
    return torch.as_tensor(a, device=device).contiguous()


@contextlib.contextmanager
def _on_stream(device: torch.device):
    """Order a cuda-backend launch after torch's pending work and before torch's next."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.current_stream(device).synchronize()
    yield
    from numba import cuda  # only here: CPU-only users never need numba.cuda

    cuda.synchronize()


# ---------------------------------------------------------------------------
# one description per function; the operators are built from it


@dataclass(frozen=True)
class _Function:
    """How one attnnb function crosses the operator boundary.

    ``params``: the forward operator's inputs, ``(name, schema type)`` in
    order (the NumPy function's ``pattern`` is assembled from
    ``pattern_indptr``, ``pattern_indices``, ``pattern_heads``).  ``has_lse``: the operator
    returns ``(out, lse)`` (always computed: the backward needs it), else
    ``out``.
    """

    name: str
    numpy_function: Any
    params: tuple
    has_lse: bool

    @property
    def names(self) -> tuple:
        return tuple(n for n, _ in self.params)

    def schema(self) -> str:
        args = ", ".join(f"{t} {n}" for n, t in self.params)
        return f"({args}) -> " + ("(Tensor, Tensor)" if self.has_lse else "Tensor")

    def backward_schema(self) -> str:
        saved = ["Tensor? dout"] + (["Tensor? dlse", "Tensor out", "Tensor lse"]
                                     if self.has_lse else ["Tensor out"])
        args = ", ".join(saved + [f"{t} {n}" for n, t in self.params])
        return f"({args}) -> Tensor[]"

    def numpy_call(self, values: dict) -> dict:
        """The NumPy function's keyword arguments for the operator inputs ``values``."""
        kwargs = {n: (_array(x) if isinstance(x, torch.Tensor) else x) for n, x in values.items()}
        heads = kwargs.pop("sigmoid_bias_heads", None)
        if heads is not None:
            kwargs["sigmoid_bias"] = heads
        if "pattern_indptr" in kwargs:
            q, k = values["q"], values["k"]
            kwargs["pattern"] = Pattern(kwargs.pop("pattern_indptr"),
                                        kwargs.pop("pattern_indices"),
                                        (q.shape[-2], k.shape[-2]), kwargs.pop("pattern_heads"))
        if self.has_lse:
            kwargs["return_lse"] = True
        return kwargs

    def bridge_call(self, values: dict) -> tuple[dict, dict]:
        """The same split as :mod:`attnnb._bridges.common` takes it: ``(arrays given, the
        rest)``."""
        kwargs = self.numpy_call(values)
        names = _bridge.ARRAYS[self.name]
        arrays = {n: kwargs.pop(n) for n in names if kwargs.get(n) is not None}
        return arrays, {n: x for n, x in kwargs.items() if n not in names}

    def differentiable(self, values: dict) -> list[str]:
        """The differentiable inputs that were given, in the backward operator's output order."""
        return [n for n in self.names if n in _DIFFERENTIABLE and values[n] is not None]


_STATIC_TAIL = (("scale", "float?"),)
_FUNCTIONS = {
    f.name: f for f in (
        _Function("attention", _np_attention,
                  (("q", "Tensor"), ("k", "Tensor"), ("v", "Tensor"), ("mask", "Tensor?"),
                   ("bias", "Tensor?"), ("key_size", "Tensor?"), ("causal", "bool"),
                   *_STATIC_TAIL, ("normalizer", "str"), ("dropout_p", "float"),
                   ("seed", "int"), ("sinks", "Tensor?"), ("sigmoid_bias", "float?"),
                   ("sigmoid_bias_heads", "Tensor?"), ("backend", "str?")),
                  True),
        _Function("sparse_attention", _np_sparse_attention,
                  (("q", "Tensor"), ("k", "Tensor"), ("v", "Tensor"),
                   ("pattern_indptr", "Tensor"), ("pattern_indices", "Tensor"),
                   ("pattern_heads", "int"), ("key_size", "Tensor?"), *_STATIC_TAIL,
                   ("normalizer", "str"), ("dropout_p", "float"), ("seed", "int"),
                   ("sinks", "Tensor?"), ("sigmoid_bias", "float?"), ("backend", "str?")),
                  True),
        _Function("topk_attention", _np_topk_attention,
                  (("q", "Tensor"), ("k", "Tensor"), ("v", "Tensor"), ("top_k", "int"),
                   ("mask", "Tensor?"), ("causal", "bool"), ("key_size", "Tensor?"),
                   *_STATIC_TAIL, ("normalizer", "str"), ("dropout_p", "float"), ("seed", "int"),
                   ("sinks", "Tensor?"), ("sigmoid_bias", "float?"), ("backend", "str?")),
                  True),
        _Function("diff_attention", _np_diff_attention,
                  (("q", "Tensor"), ("k", "Tensor"), ("v", "Tensor"), ("lam", "Tensor"),
                   ("mask", "Tensor?"), ("bias", "Tensor?"), ("key_size", "Tensor?"),
                   ("causal", "bool"), *_STATIC_TAIL, ("mode", "str"), ("dropout_p", "float"),
                   ("seed", "int"), ("sinks", "Tensor?"), ("backend", "str?")),
                  False),
    )
}


def _compute_dtype(values: dict) -> torch.dtype:
    """float64 when any of q, k, v is, else float32: the operators see only these two."""
    if any(values[n].dtype == torch.float64 for n in ("q", "k", "v")):
        return torch.float64
    return torch.float32


def _forward(fn: _Function, *inputs):
    values = dict(zip(fn.names, inputs))
    device = values["q"].device
    with _on_stream(device):
        result = fn.numpy_function(**fn.numpy_call(values))
    if fn.has_lse:
        return tuple(_tensor(r, device) for r in result)
    return _tensor(result, device)


def _forward_fake(fn: _Function, *inputs):
    """Shapes and dtypes of the results, for tracing (torch.compile, meta tensors)."""
    values = dict(zip(fn.names, inputs))
    q, v = values["q"], values["v"]
    if q.dim() == 2:
        rows = (q.shape[0],)
    else:
        heads = q.shape[-3] // 2 if fn.name == "diff_attention" else q.shape[-3]
        rows = (*q.shape[:-3], heads, q.shape[-2])
    dtype = _compute_dtype(values)
    out = q.new_empty((*rows, v.shape[-1]), dtype=dtype)
    if fn.has_lse:
        return out, q.new_empty(rows, dtype=dtype)
    return out


def _backward(fn: _Function, *inputs):
    n_saved = 4 if fn.has_lse else 2
    saved, values = inputs[:n_saved], dict(zip(fn.names, inputs[n_saved:]))
    if fn.has_lse:
        dout, dlse, out, lse = saved
        residuals = (_array(out), _array(lse))
    else:
        (dout, out), dlse = saved, None
        residuals = (_array(out), None)
    device = values["q"].device
    arrays, static = fn.bridge_call(values)
    dout = torch.zeros_like(out) if dout is None else dout
    with _on_stream(device):
        grads = _bridge.backward(fn.name, arrays, static, residuals, _array(dout),
                                 None if dlse is None else _array(dlse))
    return [_tensor(grads[_GRADIENT_OF.get(n, n)], device).to(values[n].dtype)
            for n in fn.differentiable(values)]


def _backward_fake(fn: _Function, *inputs):
    values = dict(zip(fn.names, inputs[4 if fn.has_lse else 2:]))
    return [torch.empty_like(values[n], memory_format=torch.contiguous_format)
            for n in fn.differentiable(values)]


def _setup_context(fn: _Function):
    def setup_context(ctx, inputs, output):
        ctx.set_materialize_grads(False)  # unused outputs' cotangents arrive as None
        outputs = output if fn.has_lse else (output,)
        tensors = [x if isinstance(x, torch.Tensor) else None for x in inputs]
        ctx.save_for_backward(*outputs, *tensors)
        ctx.statics = [None if isinstance(x, torch.Tensor) else x for x in inputs]
    return setup_context


def _autograd_backward(fn: _Function, backward_op):
    n_out = 2 if fn.has_lse else 1

    def backward(ctx, *cotangents):
        outputs = ctx.saved_tensors[:n_out]
        tensors = ctx.saved_tensors[n_out:]
        inputs = [t if s is None else s for t, s in zip(tensors, ctx.statics)]
        if all(c is None for c in cotangents):
            return (None,) * len(inputs)
        saved = (cotangents[0], cotangents[1], *outputs) if fn.has_lse else \
            (cotangents[0], outputs[0])
        grads = iter(backward_op(*saved, *inputs))
        values = dict(zip(fn.names, inputs))
        given = set(fn.differentiable(values))
        result = []
        for i, name in enumerate(fn.names):
            g = next(grads) if name in given else None
            result.append(g if ctx.needs_input_grad[i] else None)
        return tuple(result)
    return backward


def _register(fn: _Function):
    """Define ``attnnb::<name>`` and ``attnnb::<name>_backward``, their fake and autograd rules."""
    def forward(*inputs):
        return _forward(fn, *inputs)

    def backward(*inputs):
        return _backward(fn, *inputs)

    forward_op = torch.library.custom_op(f"{_NAMESPACE}::{fn.name}", forward, mutates_args=(),
                                         schema=fn.schema())
    backward_op = torch.library.custom_op(f"{_NAMESPACE}::{fn.name}_backward", backward,
                                          mutates_args=(), schema=fn.backward_schema())
    forward_op.register_fake(lambda *inputs: _forward_fake(fn, *inputs))
    backward_op.register_fake(lambda *inputs: _backward_fake(fn, *inputs))
    forward_op.register_autograd(_autograd_backward(fn, backward_op),
                                 setup_context=_setup_context(fn))
    return forward_op


_OPS = {name: _register(fn) for name, fn in _FUNCTIONS.items()}


# ---------------------------------------------------------------------------
# argument preparation (the public functions)


def _qkv(q, k, v):
    """q, k, v as the operators take them, and the dtype of the user's result.

    float16 and bfloat16 are cast to float32 (differentiably): the kernels
    compute in float32 or float64 only.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor; got dtype {x.dtype}")
    devices = {q.device, k.device, v.device}
    if len(devices) > 1:
        raise ValueError(f"q, k and v must be on one device; got {sorted(map(str, devices))}")
    result = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    wide = (torch.float32, torch.float64)
    return tuple(x if x.dtype in wide else x.float() for x in (q, k, v)), result


def _optional(name: str, x, device, *, floating: bool):
    """A tensor argument (or None) on ``device``; floating ones in float32/float64."""
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(np.asarray(x), device=device)
    if x.device != device:
        raise ValueError(f"{name} must be on the device of q ({device}); got {x.device}")
    if floating and x.dtype not in (torch.float32, torch.float64):
        if x.is_complex():
            raise TypeError(f"{name} must be real; got dtype {x.dtype}")
        x = x.float()
    return x


def _scale(scale):
    return None if scale is None else float(scale)


def _sigmoid_bias(sigmoid_bias):
    """``sigmoid_bias`` for the operator's ``float?``: None, or a real number (a 0-d
    tensor that needs no gradient is read once: the bias is a constant)."""
    if isinstance(sigmoid_bias, torch.Tensor) and sigmoid_bias.dim() == 0 \
            and not sigmoid_bias.requires_grad:
        sigmoid_bias = sigmoid_bias.item()
    if sigmoid_bias is None:
        return None
    if isinstance(sigmoid_bias, (bool, np.bool_)) or not isinstance(sigmoid_bias, numbers.Real):
        raise TypeError("sigmoid_bias must be a real number (one bias for every head); got "
                        f"{type(sigmoid_bias).__name__} {sigmoid_bias!r}")
    return float(sigmoid_bias)


def _sigmoid_biases(sigmoid_bias, device) -> tuple:
    """``(number, tensor)`` for the operator's ``sigmoid_bias`` and ``sigmoid_bias_heads``:
    an array or a tensor of one or more axes (or a 0-d tensor that needs a gradient, as
    one of shape ``(1,)``) is a learned bias, one per query head; the rest
    :func:`_sigmoid_bias`."""
    learned = (isinstance(sigmoid_bias, torch.Tensor)
               and (sigmoid_bias.dim() or sigmoid_bias.requires_grad)) or \
        (isinstance(sigmoid_bias, np.ndarray) and sigmoid_bias.ndim)
    if not learned:
        return _sigmoid_bias(sigmoid_bias), None
    heads = _optional("sigmoid_bias", sigmoid_bias, device, floating=True)
    return None, heads.reshape(1) if heads.dim() == 0 else heads


def _chosen(backend):
    """``backend``, with None resolved now (:func:`attnnb.use_backend` of this thread,
    then ``ATTNNB_BACKEND``, then ``"auto"``): the operator and its backward then
    carry the name, so the backward runs where the forward ran, whatever thread
    autograd runs it on and whatever context is active then."""
    return _dispatch.requested_backend(backend)


def _dropout_seed(dropout_p, seed) -> tuple[float, int]:
    """``(dropout_p, seed)`` for the operator: a seed below ``2**63`` (the schema's int),
    drawn from PyTorch's default generator when dropout is on and none is given."""
    if isinstance(dropout_p, torch.Tensor):
        dropout_p = dropout_p.item()
    if seed is None and not isinstance(dropout_p, bool) and dropout_p != 0:
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
    p, seed = check_dropout(dropout_p, seed)
    if seed >= 2**63:
        raise ValueError(f"seed must be below 2**63 in attnnb.torch (an int64); got {seed}")
    return p, seed


def _finish(out, lse, result_dtype, return_lse):
    out = out.to(result_dtype)
    return (out, lse) if return_lse else out


def attention(q, k, v, *, mask=None, bias=None, key_size=None, causal=False, scale=None,
              normalizer="softmax", return_lse=False, dropout_p=0.0, seed=None, sinks=None,
              sigmoid_bias=None, mask_mod=None, score_mod=None, backend=None):
    """:func:`attnnb.attention` on tensors, differentiable in q, k, v, bias, key_size, sinks.

    Parameters and results as :func:`attnnb.attention`, with ``torch.Tensor``
    for arrays (``mask``, ``bias`` and ``key_size`` may also be NumPy arrays
    or numbers: they are converted).  The result has the promoted dtype of
    q, k and v on their device; ``lse`` is float32, or float64 for float64
    inputs.  With ``dropout_p > 0`` and no ``seed``, the seed is drawn from
    PyTorch's default generator (so ``torch.manual_seed`` reproduces a run);
    the backward regenerates the same decisions from it.

    ``mask_mod`` and ``score_mod`` (:mod:`attnnb.mods`, built from CPU tensors
    or NumPy arrays) run through an autograd function around
    :func:`attnnb.vjp` instead of the ``attnnb::`` operator
    (:mod:`attnnb._bridges.torch_mods`): the score function's floating tensor
    parameters get ``.grad``; ``torch.compile`` breaks the graph there.

    Examples
    --------
    >>> import torch, attnnb.torch as at
    >>> q = torch.randn(2, 4, 16, 8, requires_grad=True)
    >>> out = at.attention(q, q, q, causal=True)
    >>> out.sum().backward()
    >>> q.grad.shape
    torch.Size([2, 4, 16, 8])
    """
    (q, k, v), result = _qkv(q, k, v)
    dropout_p, seed = _dropout_seed(dropout_p, seed)
    mask = _optional("mask", mask, q.device, floating=False)
    bias = _optional("bias", bias, q.device, floating=True)
    key_size = _optional("key_size", key_size, q.device, floating=True)
    sinks = _optional("sinks", sinks, q.device, floating=True)
    constant_bias, learned_bias = _sigmoid_biases(sigmoid_bias, q.device)
    if mask_mod is not None or score_mod is not None:
        named = dict(q=q, k=k, v=v, mask=mask, bias=bias, key_size=key_size, sinks=sinks)
        static = dict(causal=check_bool("causal", causal), scale=_scale(scale),
                      normalizer=normalizer, dropout_p=dropout_p, seed=seed,
                      backend=_chosen(backend))
        (named if learned_bias is not None else static)["sigmoid_bias"] = \
            learned_bias if learned_bias is not None else constant_bias
        out, lse = _with_mods(_np_attention, lambda a: (a["q"], a["k"], a["v"]), named, static,
                              mask_mod, score_mod)
        return _finish(out, lse, result, check_bool("return_lse", return_lse))
    out, lse = _OPS["attention"](
        q, k, v, mask, bias, key_size, check_bool("causal", causal), _scale(scale), normalizer,
        dropout_p, seed, sinks, constant_bias, learned_bias, _chosen(backend))
    return _finish(out, lse, result, check_bool("return_lse", return_lse))


def _with_mods(function, positional, named, static, mask_mod, score_mod, lse=True):
    """A call with mask or score functions (:mod:`attnnb._bridges.torch_mods`); ``lse``: the
    function has one (it is returned, with the output)."""
    from ._bridges import torch_mods as _torch_mods
    from .mods import as_mask_mod, as_score_mod

    mask_mod, score_mod = as_mask_mod(mask_mod), as_score_mod(score_mod)
    static = dict(static, mask_mod=mask_mod, score_mod=score_mod)
    if lse:
        static["return_lse"] = True
    return _torch_mods.call(function, positional, named, static, score_mod, lse)


def _pattern_tensors(pattern) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A Pattern's CSR arrays as tensors sharing its (read-only) memory."""
    if not isinstance(pattern, Pattern):
        raise TypeError("pattern must be an attnnb.patterns.Pattern (build one with "
                        "attnnb.patterns.local, ..., from_mask or from_scipy); got "
                        f"{type(pattern).__name__}")
    with warnings.catch_warnings():  # the arrays are read-only; the operators only read them
        warnings.simplefilter("ignore", UserWarning)
        return (torch.from_numpy(pattern.indptr), torch.from_numpy(pattern.indices),
                pattern.n_heads)


def sparse_attention(q, k, v, pattern, *, key_size=None, scale=None, normalizer="softmax",
                     return_lse=False, dropout_p=0.0, seed=None, sinks=None, sigmoid_bias=None,
                     mask_mod=None, score_mod=None, backend=None):
    """:func:`attnnb.sparse_attention` on tensors, differentiable in q, k, v, key_size, sinks.

    ``pattern`` is an :class:`attnnb.patterns.Pattern` (a constant).
    Parameters and results otherwise as :func:`attention` here (dropout and mods too).
    """
    (q, k, v), result = _qkv(q, k, v)
    dropout_p, seed = _dropout_seed(dropout_p, seed)
    if mask_mod is not None or score_mod is not None:
        _pattern_tensors(pattern)  # its check
        out, lse = _with_mods(_np_sparse_attention, lambda a: (a["q"], a["k"], a["v"], pattern),
                              dict(q=q, k=k, v=v, key_size=_optional(
                                  "key_size", key_size, q.device, floating=True),
                                  sinks=_optional("sinks", sinks, q.device, floating=True)),
                              dict(scale=_scale(scale), normalizer=normalizer,
                                   dropout_p=dropout_p, seed=seed,
                                   sigmoid_bias=_sigmoid_bias(sigmoid_bias),
                                   backend=_chosen(backend)), mask_mod, score_mod)
        return _finish(out, lse, result, check_bool("return_lse", return_lse))
    indptr, indices, heads = _pattern_tensors(pattern)  # host tensors on every device: the
    # pattern is rebuilt on the host inside the operator
    out, lse = _OPS["sparse_attention"](
        q, k, v, indptr, indices, heads,
        _optional("key_size", key_size, q.device, floating=True), _scale(scale), normalizer,
        dropout_p, seed, _optional("sinks", sinks, q.device, floating=True),
        _sigmoid_bias(sigmoid_bias), _chosen(backend))
    return _finish(out, lse, result, check_bool("return_lse", return_lse))


def topk_attention(q, k, v, top_k, *, mask=None, causal=False, key_size=None, scale=None,
                   normalizer="softmax", return_lse=False, dropout_p=0.0, seed=None,
                   sinks=None, sigmoid_bias=None, mask_mod=None, score_mod=None, backend=None):
    """:func:`attnnb.topk_attention` on tensors, differentiable in q, k, v, key_size, sinks.

    The selection (each row's ``top_k`` keys) is a constant of the
    gradient, as in :func:`attnnb.vjp`.  Parameters and results otherwise
    as :func:`attention` here (dropout and mods too).
    """
    (q, k, v), result = _qkv(q, k, v)
    dropout_p, seed = _dropout_seed(dropout_p, seed)
    if isinstance(top_k, bool) or not hasattr(top_k, "__index__"):
        raise TypeError(f"top_k must be an integer; got {type(top_k).__name__} {top_k!r}")
    top_k = int(top_k.__index__())
    mask = _optional("mask", mask, q.device, floating=False)
    key_size = _optional("key_size", key_size, q.device, floating=True)
    sinks = _optional("sinks", sinks, q.device, floating=True)
    if mask_mod is not None or score_mod is not None:
        out, lse = _with_mods(_np_topk_attention, lambda a: (a["q"], a["k"], a["v"], top_k),
                              dict(q=q, k=k, v=v, mask=mask, key_size=key_size, sinks=sinks),
                              dict(causal=check_bool("causal", causal), scale=_scale(scale),
                                   normalizer=normalizer, dropout_p=dropout_p, seed=seed,
                                   sigmoid_bias=_sigmoid_bias(sigmoid_bias),
                                   backend=_chosen(backend)),
                              mask_mod, score_mod)
        return _finish(out, lse, result, check_bool("return_lse", return_lse))
    out, lse = _OPS["topk_attention"](
        q, k, v, top_k, mask, check_bool("causal", causal), key_size, _scale(scale), normalizer,
        dropout_p, seed, sinks, _sigmoid_bias(sigmoid_bias), _chosen(backend))
    return _finish(out, lse, result, check_bool("return_lse", return_lse))


def diff_attention(q, k, v, lam, *, mask=None, bias=None, key_size=None, causal=False,
                   scale=None, mode="difference", dropout_p=0.0, seed=None, sinks=None,
                   mask_mod=None, score_mod=None, backend=None):
    """:func:`attnnb.diff_attention` on tensors, differentiable in q, k, v, lam, bias, key_size,
    sinks.

    ``lam`` may be a number (no gradient) or a tensor broadcastable to
    ``(*batch, H, Lq)``, e.g. the learned ``lambda_full`` of the Diff
    Transformer as a 0-d tensor.  Parameters and results otherwise as
    :func:`attnnb.diff_attention` (dropout and mods as in :func:`attention` here).
    """
    dropout_p, seed = _dropout_seed(dropout_p, seed)
    (q, k, v), result = _qkv(q, k, v)
    lam = _optional("lam", lam, q.device, floating=True)
    mask = _optional("mask", mask, q.device, floating=False)
    bias = _optional("bias", bias, q.device, floating=True)
    key_size = _optional("key_size", key_size, q.device, floating=True)
    sinks = _optional("sinks", sinks, q.device, floating=True)
    if mask_mod is not None or score_mod is not None:
        out = _with_mods(_np_diff_attention, lambda a: (a["q"], a["k"], a["v"], a["lam"]),
                         dict(q=q, k=k, v=v, lam=lam, mask=mask, bias=bias, key_size=key_size,
                              sinks=sinks),
                         dict(causal=check_bool("causal", causal), scale=_scale(scale),
                              mode=mode, dropout_p=dropout_p, seed=seed,
                              backend=_chosen(backend)), mask_mod, score_mod, lse=False)
        return out.to(result)
    out = _OPS["diff_attention"](
        q, k, v, lam, mask, bias, key_size, check_bool("causal", causal), _scale(scale), mode,
        dropout_p, seed, sinks, _chosen(backend))
    return out.to(result)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *, sinks=None,
                                 mask_mod=None, score_mod=None):
    """A drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

    Same arguments, meaning and refusals as PyTorch's function (torch 2.13):
    ``query (N, ..., Hq, L, E)``, ``key (N, ..., H, S, E)``, ``value (N, ...,
    H, S, Ev)``, every axis before the last two broadcast between them; a bool
    ``attn_mask`` is True where attending, a float one (float32 or the
    query's dtype) is added to the scaled logits (and gets a gradient when it
    requires one), and a ``torch.nn.attention.bias.CausalBias`` asks for
    either causal alignment; ``is_causal`` masks top-left (query ``i`` sees
    keys ``j <= i``, also when ``L != S``); ``scale`` defaults to
    ``1 / sqrt(E)``; ``enable_gqa`` lets ``Hq`` be a multiple of ``H``.  So
    that a model switches to attnnb by replacing this one function.  How
    each argument is read: :mod:`attnnb._bridges.torch_sdpa`.  One keyword of
    attnnb's own, ``sinks`` (a tensor broadcastable to the query heads,
    differentiable), adds learned attention sinks (:func:`attention`), and
    ``score_mod`` (:mod:`attnnb.mods`) rewrites the scaled logits before the
    mask (``mods.softcap`` for Gemma 2's soft-capping) and ``mask_mod``
    narrows the allowed keys further (``mods.sliding_window`` for a model's
    window), both in the whole call's positions (bottom-right aligned
    built-ins, whatever ``is_causal``'s alignment).

    Raises
    ------
    attnnb._bridges.torch_sdpa.SDPAError
        (a ``RuntimeError`` and a ``ValueError``) where PyTorch raises
        ``RuntimeError``: both ``attn_mask`` and ``is_causal``, shapes that do
        not broadcast, q, k, v of different dtypes.
    attnnb._bridges.torch_sdpa.SDPATypeError
        (a ``TypeError`` and a ``RuntimeError``): a mask dtype PyTorch
        refuses, a tensor subclass or sparse tensor the drop-in does not
        understand.

    Notes
    -----
    A row with no allowed key gives zeros, as PyTorch's CPU kernels give
    them (checked against torch 2.13); its gradients are zeros too.
    """
    _sdpa.check_qkv(query, key, value, dropout_p)
    query, key, value = _sdpa.broadcast_qkv(query, key, value, check_bool("enable_gqa",
                                                                          enable_gqa))
    plan = _sdpa.mask_plan(attn_mask, check_bool("is_causal", is_causal), query, key)
    if (dropout_p or score_mod is not None or mask_mod is not None) and len(plan.segments) > 1:
        # dropout's decisions and the score function's positions are whole-call rows
        plan = _sdpa.as_one_mask(plan, query, key)
    dropout_p, seed = _dropout_seed(dropout_p, None)
    outs = []
    for seg in plan.segments:  # a mask or bias comes with one segment: all rows, all keys
        rows, keys = slice(seg.row_start, seg.row_stop), slice(0, seg.key_stop)
        outs.append(attention(query[..., rows, :], key[..., keys, :], value[..., keys, :],
                              mask=plan.mask, bias=plan.bias, causal=seg.causal, scale=scale,
                              dropout_p=dropout_p, seed=seed, sinks=sinks,
                              mask_mod=mask_mod, score_mod=score_mod))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)

"""Backend registry and selection.

Implementations are registered by *import path* (``"module:function"``) so
that ``import attnnb`` imports neither Numba nor numba-cuda; a backend's
module is imported the first time one of its operations is called.

Selection order for ``backend=None``: the innermost :func:`use_backend`
context, then the ``ATTNNB_BACKEND`` environment variable, then ``"auto"``
(``"cuda"`` when any input is a CUDA device array, otherwise ``"cpu"``).
A backend that cannot run raises :class:`RuntimeError` saying why; nothing
ever falls back silently to another backend.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import threading
from collections.abc import Callable, Iterator

BACKENDS = ("reference", "cpu", "cuda")

# (operation, backend) -> "module:function"
_REGISTRY: dict[tuple[str, str], str] = {}
_LOADED: dict[tuple[str, str], Callable] = {}
_LOCK = threading.Lock()
_CONTEXT = threading.local()


def register(operation: str, backend: str, target: str) -> None:
    """Register ``target`` (``"package.module:function"``) for ``(operation, backend)``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    _REGISTRY[(operation, backend)] = target


def _availability(backend: str) -> tuple[bool, str]:
    if backend == "reference":
        return True, "NumPy, float64"
    if backend == "cpu":
        try:
            import numba
        except Exception as exc:  # pragma: no cover - numba is a dependency
            return False, f"numba cannot be imported: {exc}"
        return True, f"numba {numba.__version__}"
    if backend == "cuda":
        return _cuda_availability()
    return False, f"unknown backend {backend!r}"


_CUDA_STATUS: tuple[bool, str] | None = None


def _cuda_availability() -> tuple[bool, str]:
    global _CUDA_STATUS
    if _CUDA_STATUS is None:
        _CUDA_STATUS = _probe_cuda()
    return _CUDA_STATUS


def _probe_cuda() -> tuple[bool, str]:
    # Numba still ships a deprecated numba.cuda of its own; the backend is built and
    # tested on the numba-cuda package (the ``cuda`` extra), so require that one.
    if importlib.util.find_spec("numba_cuda") is None:
        return False, "numba-cuda is not installed (pip install 'attnnb[cuda]')"
    try:
        from numba import cuda
    except Exception as exc:
        return False, f"numba.cuda cannot be imported ({exc}); pip install 'attnnb[cuda]'"
    simulated = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"
    try:
        if simulated:
            return True, "Numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1)"
        if not cuda.is_available():
            return False, _why_no_cuda()
        dev = cuda.get_current_device()
        name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
        return True, f"{name}, compute capability {dev.compute_capability}"
    except Exception as exc:
        return False, f"CUDA is not usable: {exc}"


def _why_no_cuda() -> str:
    """Tell a missing driver from a driver that sees no device."""
    try:
        from numba.cuda.cudadrv.driver import driver

        count = driver.get_device_count()
    except Exception as exc:
        first = str(exc).strip().splitlines()
        detail = " ".join(line.strip() for line in first if line.strip())[:200]
        return f"no usable CUDA driver ({detail or type(exc).__name__})"
    if count == 0:
        return "the CUDA driver found no GPU"
    return "numba.cuda.is_available() is False (no supported GPU)"


def backends() -> dict[str, tuple[bool, str]]:
    """Which backends run here, and why (not).

    Returns
    -------
    dict
        ``{name: (available, reason)}`` for ``"reference"``, ``"cpu"`` and
        ``"cuda"``.
    """
    return {name: _availability(name) for name in BACKENDS}


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[str]:
    """Context manager: calls with ``backend=None`` inside use ``name``.

    The setting is per thread.  ``name`` may be ``"auto"``; any other name
    than a backend's is a ``ValueError`` naming ``use_backend()`` (raised on
    entry, before any call inside runs).
    """
    if name not in BACKENDS + ("auto",):
        raise ValueError(f"use_backend() must be one of {BACKENDS + ('auto',)}; got {name!r}")
    stack = getattr(_CONTEXT, "stack", None)
    if stack is None:
        stack = _CONTEXT.stack = []
    stack.append(name)
    try:
        yield name
    finally:
        stack.pop()


def requested_backend(backend: str | None) -> str:
    """The backend name a call asks for: ``"auto"`` or a backend, not yet checked to run.

    ``backend=None`` reads the innermost :func:`use_backend` context of this
    thread, then ``ATTNNB_BACKEND``, then ``"auto"``.  An unknown name is a
    ``ValueError`` naming where it came from.
    """
    if backend is None:
        stack = getattr(_CONTEXT, "stack", None)
        backend = stack[-1] if stack else os.environ.get("ATTNNB_BACKEND", "auto") or "auto"
        source = "ATTNNB_BACKEND" if not stack else "use_backend()"
    else:
        source = "backend"
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"{source} must be one of {BACKENDS + ('auto',)}; got {backend!r}")
    return backend


def choose_backend(backend: str | None, on_device: bool) -> str:
    """Resolve ``backend`` (None, "auto" or a name) to a backend that can run."""
    backend = requested_backend(backend)
    if backend == "auto":
        backend = "cuda" if on_device else "cpu"
    if on_device and backend != "cuda":
        raise TypeError(
            f"inputs are CUDA device arrays but backend {backend!r} runs on the host; "
            "use backend='cuda' or copy the arrays to the host first"
        )
    ok, why = _availability(backend)
    if not ok:
        raise RuntimeError(f"backend {backend!r} is not available: {why}")
    return backend


def _not_implemented(operation: str, backend: str) -> NotImplementedError:
    """The error for an operation that ``backend`` lacks (a :class:`RuntimeError` too).

    Gradient operations (``"<function>_vjp"``) say so in words, as that is what
    a user calling :func:`attnnb.vjp` asked for.
    """
    if operation.endswith(_VJP_SUFFIX):
        function = operation[: -len(_VJP_SUFFIX)]
        return NotImplementedError(
            f"{function} gradients are not implemented on the {backend} backend yet"
        )
    return NotImplementedError(f"operation {operation!r} is not implemented on backend {backend!r}")


def implementation(operation: str, backend: str) -> Callable:
    """The callable registered for ``(operation, backend)``, importing it on first use.

    An operation that the backend does not implement is a
    :class:`NotImplementedError` (a subclass of :class:`RuntimeError`).
    """
    key = (operation, backend)
    fn = _LOADED.get(key)
    if fn is not None:
        return fn
    missing = _not_implemented(operation, backend)
    target = _REGISTRY.get(key)
    if target is None:
        raise missing
    module, _, name = target.partition(":")
    with _LOCK:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            # Only the backend's own module (or its package) being absent means "not
            # implemented"; a dependency missing inside it is a real error to surface.
            if exc.name is None or not (module == exc.name or module.startswith(exc.name + ".")):
                raise
            raise missing from exc
        fn = getattr(mod, name, None)
        if fn is None:
            raise missing
        _LOADED[key] = fn
    return fn


def call(operation: str, backend: str | None, on_device: bool, *args, **kwargs):
    """Resolve the backend and run ``operation`` on it."""
    chosen = choose_backend(backend, on_device)
    return implementation(operation, chosen)(*args, **kwargs)


# Every operation, and where each backend implements it: the function
# ``attnnb.<backend>.<module>:<function>``, called with the canonical problem
# (and operation-specific arguments) built by the public function.
OPERATIONS = {
    "attention": ("attention", "attention"),
    "sparse_attention": ("sparse", "sparse_attention"),
    "topk_attention": ("topk", "topk_attention"),
    "diff_attention": ("diff", "diff_attention"),
    "tome_match": ("tome", "match"),
    "tome_merge": ("tome", "merge"),
    "tome_unmerge": ("tome", "unmerge"),
}

for _op, (_module, _function) in OPERATIONS.items():
    for _backend in BACKENDS:
        register(_op, _backend, f"attnnb.{_backend}.{_module}:{_function}")

# ToMe's size-weighted merge of device arrays in one kernel (attnnb.tome.merge_wavg):
# host arrays take two merges and NumPy arithmetic in the public layer instead.
register("tome_merge_wavg", "cuda", "attnnb.cuda.tome:merge_wavg")

# The statistics of dense attention's weights (attnnb.attention_stats) in one compiled
# pass; every other call's are reduced from its rows' weights on the host.
register("attention_stats", "cpu", "attnnb.cpu.stats:attention_stats")
register("attention_stats", "cuda", "attnnb.cuda.stats:attention_stats")

# Gradients (attnnb.vjp): one backward operation per differentiable function,
# ``"<function>_vjp"``, with the interface documented in :mod:`attnnb.vjp`.  Only
# the backends listed in GRADIENT_BACKENDS implement them so far; elsewhere
# :func:`implementation` raises NotImplementedError saying so.
_VJP_SUFFIX = "_vjp"
GRADIENT_OPERATIONS = {
    "attention_vjp": ("backward", "attention_vjp"),
    "sparse_attention_vjp": ("backward", "sparse_attention_vjp"),
    "topk_attention_vjp": ("backward", "topk_attention_vjp"),
    "diff_attention_vjp": ("backward", "diff_attention_vjp"),
}
GRADIENT_BACKENDS = ("reference", "cpu", "cuda")

for _op, (_module, _function) in GRADIENT_OPERATIONS.items():
    for _backend in GRADIENT_BACKENDS:
        register(_op, _backend, f"attnnb.{_backend}.{_module}:{_function}")

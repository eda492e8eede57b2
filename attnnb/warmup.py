"""The engine behind ``python -m attnnb warmup``: every cpu kernel into the on-disk cache.

What is compiled
    The kernels of :mod:`attnnb.cpu`, in the specialisations the public
    functions reach, found by calling them: every case of
    :mod:`attnnb.checks` (each function with each option that selects
    another kernel or other argument types, and the gradients through
    :func:`attnnb.vjp`, float32 and float64) runs once on the ``"cpu"``
    backend.  Numba compiles one machine-code specialisation per kernel and
    tuple of argument types, and a new process loads each from the on-disk
    cache on its first call; here a *kernel* is one such pair.  A call whose
    arguments Numba types differently (another dtype, a mask or bias laid
    out C-contiguous rather than broadcast) compiles on its first call as
    before.

How the work is spread
    ``jobs`` worker processes (spawned: none inherits the parent's state)
    take the cases from a queue.  Cases share kernels (every dense float32
    case needs the one dense float32 kernel), so each worker claims a kernel
    before compiling it, by creating a file exclusively in a directory that
    lives as long as the run (:class:`_Claims`).  A worker that reaches a
    kernel claimed by another gives its case back; the case goes to the end
    of the queue and, when its turn comes again, waits for that kernel and
    loads it from the cache.  Numba keeps one index file per kernel function
    for all its specialisations and rewrites it on every save, so two
    workers saving two specialisations of one function at once could lose
    an entry; saves are serialised per index file with a file lock.  Both
    hooks wrap Numba internals (``Dispatcher.compile``,
    ``Cache.save_overload``) in the worker processes only.

Output
    A progress bar on stderr (tqdm where installed) and a closing line,
    :meth:`Summary.line`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import os
import pkgutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor
from concurrent.futures import wait as wait_any

from ._tools.progress import progress
from .check import Case, discover_cases

try:  # a lock that the OS releases when its holder dies
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None
    import msvcrt

KERNEL_PACKAGE = f"{__package__}.cpu"
_POLL_S = 0.05  # how often a worker waiting for another one's kernel looks again


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel specialisation made ready: compiled, or loaded from the on-disk cache."""

    name: str  # the kernel function, "attnnb.cpu.attention.attention_kernel"
    signature: str  # Numba's argument types
    seconds: float
    loaded: bool

    @property
    def label(self) -> str:
        """Short name, first dtype and a tag of the signature, for tables."""
        dtype = self.signature.split("(", 2)[-1].split(",", 1)[0] if "(" in self.signature else ""
        tag = hashlib.sha1(self.signature.encode()).hexdigest()[:6]
        return f"{self.name.rpartition('.')[2]} {dtype} [{tag}]"


@dataclasses.dataclass
class Summary:
    """What :func:`run` did.

    Attributes
    ----------
    kernels : list of :class:`Kernel`
        One per kernel specialisation; ``loaded`` when no process of this
        run compiled it.
    failures : list of ``(case, error)``
        Cases that raised; their kernels may be missing from the cache.
    seconds : float
        Wall time of the whole run.
    jobs : int
        Processes used.
    unreached : list of str
        Kernel functions of :mod:`attnnb.cpu` that no case called (only
        filled when every case ran).
    compilations : int
        Compilations done, over all processes: the kernels not loaded from
        the cache, unless two processes compiled one.
    counted : bool
        Whether kernels were recorded: False where the Numba patches are off
        (:mod:`attnnb.cpu._numba_patches`), and then :attr:`kernels` is empty.
    cases : int
        Cases run.
    """

    kernels: list[Kernel]
    failures: list[tuple[str, str]]
    seconds: float
    jobs: int
    unreached: list[str] = dataclasses.field(default_factory=list)
    compilations: int = 0
    counted: bool = True
    cases: int = 0

    @property
    def loaded(self) -> int:
        """How many of :attr:`kernels` were loaded from the cache rather than compiled."""
        return sum(k.loaded for k in self.kernels)

    def line(self) -> str:
        """The closing line: ``warmup: compiled X kernels (Y loaded from cache) in Z s ...``."""
        noun = "process" if self.jobs == 1 else "processes"
        if not self.counted:
            return (f"warmup: ran {self.cases} cases in {self.seconds:.1f} s with {self.jobs} "
                    f"{noun} (Numba patches off: kernels not counted)")
        return (f"warmup: compiled {len(self.kernels)} kernels ({self.loaded} loaded from "
                f"cache) in {self.seconds:.1f} s with {self.jobs} {noun}")


def default_jobs() -> int:
    """The CPUs this process may run on (``os.cpu_count()`` where affinity is unknown)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


class _Busy(BaseException):
    """Another worker is compiling this kernel (a BaseException: no handler may swallow it)."""


def _holder_alive(claim: str) -> bool:
    if os.name == "nt":  # pragma: no cover - os.kill(pid, 0) is not a probe there
        return True
    try:
        with open(claim) as f:
            pid = int(f.read() or 0)
    except (OSError, ValueError):
        return True  # being written or just removed: look again later
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Claims:
    """The kernels claimed by the workers of one run: files in ``root``.

    ``key.claim`` (created exclusively, holding the claimer's pid) while a
    worker compiles the kernel, ``key.done`` once it is in the cache.
    """

    def __init__(self, root: str):
        self.root = root
        self.wait = False  # on a busy kernel: wait for it (True) or raise _Busy (False)

    def _path(self, key: str, suffix: str) -> str:
        return os.path.join(self.root, hashlib.sha1(key.encode()).hexdigest() + suffix)

    @contextlib.contextmanager
    def compiling(self, key: str):
        """Run the body once no other worker compiles ``key``, holding it meanwhile."""
        claim, done = self._path(key, ".claim"), self._path(key, ".done")
        while not os.path.exists(done):
            try:
                fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                if not _holder_alive(claim):  # it died compiling: take the kernel over
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(claim)
                    continue
                if not self.wait:
                    raise _Busy(key) from None
                time.sleep(_POLL_S)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            try:
                yield
            finally:
                open(done, "w").close()  # also after an error: the others then try themselves
            return
        yield  # compiled by another worker: the body loads it from the cache

    @contextlib.contextmanager
    def saving(self, index_path: str):
        """Hold the lock of one cache index file while Numba rewrites it."""
        with open(self._path(index_path, ".lock"), "a+b") as f:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            else:  # pragma: no cover - Windows
                msvcrt.locking(f.fileno(), msvcrt.LK_LOCK, 1)
            try:
                yield
            finally:
                if fcntl is not None:
                    fcntl.flock(f.fileno(), fcntl.LOCK_UN)
                else:  # pragma: no cover - Windows
                    f.seek(0)
                    msvcrt.locking(f.fileno(), msvcrt.LK_UNLCK, 1)


class _Hooks:
    """Wrap Numba's ``Dispatcher.compile`` (and, with claims, ``Cache.save_overload``).

    Every top-level compilation of a kernel of :mod:`attnnb.cpu` is timed and
    recorded in :attr:`records` (nested ones, of the inlined loops a kernel
    calls, belong to it); with ``claims`` it is claimed first.
    """

    def __init__(self, claims: _Claims | None = None):
        self.claims = claims
        self.records: list[Kernel] = []
        self._local = threading.local()
        self._restore = None

    def install(self) -> bool:
        """Start recording; False where the Numba patches are off (nothing recorded)."""
        from .cpu._numba_patches import compile_hooks

        hooks = self

        def compile(compile_, dispatcher, sig):
            depth = getattr(hooks._local, "depth", 0)
            py_func = getattr(dispatcher, "py_func", None)
            args = compile_hooks.argument_types(sig)
            if (depth or py_func is None or not py_func.__module__.startswith(KERNEL_PACKAGE)
                    or args in dispatcher.overloads):
                return hooks._nested(compile_, dispatcher, sig)
            name = f"{py_func.__module__}.{py_func.__qualname__}"
            claim = (hooks.claims.compiling(f"{name}{args}") if hooks.claims
                     else contextlib.nullcontext())
            with claim:
                hits = compile_hooks.cache_hits(dispatcher)
                start = time.perf_counter()
                entry = hooks._nested(compile_, dispatcher, sig)
                loaded = compile_hooks.cache_hits(dispatcher) > hits
                hooks.records.append(Kernel(name, str(args), time.perf_counter() - start,
                                            loaded))
            return entry

        def save_overload(save, cache, sig, data):
            index = compile_hooks.index_path(cache)
            if hooks.claims is None or index is None:
                return save(cache, sig, data)
            with hooks.claims.saving(index):
                return save(cache, sig, data)

        self._restore = compile_hooks.wrap(compile, save_overload)
        return self._restore is not None

    def _nested(self, fn, *args):
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            return fn(*args)
        finally:
            self._local.depth -= 1

    def uninstall(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None


def kernel_functions() -> list[str]:
    """Names of every kernel function of :mod:`attnnb.cpu` (imports all its modules)."""
    pkg = importlib.import_module(KERNEL_PACKAGE)
    names = set()
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{KERNEL_PACKAGE}.{info.name}")
        for obj in vars(module).values():
            py_func = getattr(obj, "py_func", None)
            if py_func is not None and getattr(obj, "targetoptions", {}).get("parallel"):
                names.add(f"{py_func.__module__}.{py_func.__qualname__}")
    return sorted(names)


def _run_case(run, hooks: _Hooks) -> tuple[str, list[Kernel], str]:
    """Run one case on the cpu backend: ``(status, kernels made ready, error)``."""
    start = len(hooks.records)
    status, error = "ok", ""
    try:
        run("cpu")
    except _Busy:
        status = "busy"
    except Exception as exc:
        status, error = "error", f"{type(exc).__name__}: {exc}"
    return status, hooks.records[start:], error


# ---------------------------------------------------------------- worker processes

_worker_hooks: _Hooks | None = None
_worker_cases: dict[str, dict] = {}  # module -> {case name: run}


def _worker_init(claims_root: str) -> None:
    global _worker_hooks
    _worker_hooks = _Hooks(_Claims(claims_root))
    _worker_hooks.install()


def _module_cases(module: str) -> dict:
    """``{name: run}`` of a module of :mod:`attnnb.checks`, or of any module with a
    ``cases()`` function named by its dotted path."""
    if module not in _worker_cases:
        path = module if "." in module else f"{__package__}.checks.{module}"
        _worker_cases[module] = dict(importlib.import_module(path).cases())
    return _worker_cases[module]


def _worker_run(key: tuple[str, str], wait: bool):
    module, name = key
    try:
        run = _module_cases(module).get(name)
    except ImportError as exc:
        return "error", [], f"{type(exc).__name__}: {exc}"
    if run is None:
        return "error", [], f"no case {name!r} in module {module!r}"
    _worker_hooks.claims.wait = wait
    return _run_case(run, _worker_hooks)


# ---------------------------------------------------------------- the run


def _order(cases: Sequence[Case]) -> list[Case]:
    """Forward cases first: the gradient cases also need the forward kernels."""
    return sorted(cases, key=lambda case: case[0] == "grad")


def run(cases: Sequence[Case] | None = None, *, jobs: int | None = None,
        bar: bool = True) -> Summary:
    """Compile (or load) the kernels that ``cases`` reach, in ``jobs`` processes.

    Parameters
    ----------
    cases : sequence of ``(module, name, run)``, optional
        As :func:`attnnb.check.discover_cases` returns them (default: all,
        and then :attr:`Summary.unreached` is filled).  The worker processes
        find each case by name in its module: a module of
        :mod:`attnnb.checks`, or any module with a ``cases()`` function,
        given by its dotted path.
    jobs : int, optional
        Processes (default :func:`default_jobs`; at most one per case).  With
        one, everything runs in this process.
    bar : bool
        Show a progress bar on stderr.

    Returns
    -------
    Summary
    """
    start = time.perf_counter()
    everything = cases is None
    cases = _order(discover_cases() if cases is None else cases)
    jobs = max(1, min(default_jobs() if jobs is None else int(jobs), len(cases)))
    from .cpu._numba_patches import ACTIVE as counted

    if not counted:
        jobs = 1  # without the compile hooks' claims, two workers could compile one kernel
    progress_bar = progress(len(cases), desc="warmup") if bar and cases else None
    kernels: dict[tuple[str, str], Kernel] = {}
    failures: list[tuple[str, str]] = []

    compilations = 0

    def finished(case, status, records, error):
        nonlocal compilations
        for k in records:
            compilations += not k.loaded
            seen = kernels.get((k.name, k.signature))
            if seen is None or (seen.loaded and not k.loaded):  # compiled here: not "loaded"
                kernels[(k.name, k.signature)] = k
        if status == "error":
            failures.append((case[1], error))
        if progress_bar is not None and status != "busy":  # a busy case comes round again
            progress_bar.set_description(f"warmup ({len(kernels)} kernels)")
            progress_bar.update(1)

    try:
        if jobs == 1:
            hooks = _Hooks()
            hooks.install()
            try:
                for case in cases:
                    finished(case, *_run_case(case[2], hooks))
                known = kernel_functions() if everything else []
            finally:
                hooks.uninstall()
        else:
            known = _run_pool(cases, jobs, finished, everything)
    finally:
        if progress_bar is not None:
            progress_bar.close()
    reached = {k.name for k in kernels.values()}
    unreached = [name for name in known if name not in reached] if counted else []
    return Summary(list(kernels.values()), failures, time.perf_counter() - start, jobs,
                   unreached, compilations, counted, len(cases))


def _run_pool(cases, jobs, finished, everything) -> list[str]:
    """The cases in ``jobs`` worker processes; returns :func:`kernel_functions` when
    ``everything`` (else ``[]``)."""
    import multiprocessing

    by_key = {(module, name): (module, name, fn) for module, name, fn in cases}
    queue = deque((key, False) for key in by_key)  # (case, wait for busy kernels)
    with tempfile.TemporaryDirectory(prefix="attnnb-warmup-") as claims, ProcessPoolExecutor(
            jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
            initargs=(claims,)) as pool:
        running = {}
        while queue or running:
            while queue and len(running) < jobs:
                key, wait = queue.popleft()
                running[pool.submit(_worker_run, key, wait)] = key
            done, _ = wait_any(running, return_when=FIRST_COMPLETED)
            for future in done:
                key = running.pop(future)
                status, records, error = future.result()
                if status == "busy":  # again after the others, then waiting for the kernel
                    queue.append((key, True))
                finished(by_key[key], status, records, error)
        return pool.submit(kernel_functions).result() if everything else []

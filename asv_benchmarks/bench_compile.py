"""asv benchmarks for the cold compile of representative cpu kernels.

``ColdCompile`` holds ``timeraw_`` benchmarks: asv runs the returned setup
and then the timed code in a fresh interpreter per sample.  The setup
points Numba's on-disk cache at a new, empty temporary directory before
Numba is imported (``NUMBA_CACHE_DIR`` is read then, and ``import attnnb``
does not import Numba), so the timed call compiles its kernels and the
inlined loops they call from scratch, as the first call after a fresh
install does.

* ``timeraw_attention_float32``: the dense float32 forward kernel (one
  kernel; Numba's own first-use set-up, about 0.5 s, included).
* ``ColdCompileBackward.timeraw_attention_backward_float32``: the two dense
  float32 backward kernels (``dkdv``, ``dq``); the forward they need compiles
  in the setup, untimed.  Skipped when ``ATTNNB_ASV_SKIP_SLOW`` is set (CI).

Two benchmarks of one or two kernels each, so that ``asv run --quick``
stays about a minute longer; ``python -m attnnb warmup --times`` gives
every kernel's time.
"""

from __future__ import annotations

_SETUP = """
import atexit, os, shutil, tempfile
_cache = tempfile.mkdtemp(prefix="attnnb-asv-cold-")
atexit.register(shutil.rmtree, _cache, True)
os.environ["NUMBA_CACHE_DIR"] = _cache
import numpy as np
import attnnb
q = np.random.default_rng(0).standard_normal((1, 2, 100, 64)).astype(np.float32)
"""


class _Cold:
    """What the cold-compile benchmarks share (no benchmark of its own)."""

    timeout = 600
    number = 1
    repeat = (1, 3, 120.0)  # at most three fresh processes, none after two minutes

    def setup(self):
        import attnnb

        ok, why = attnnb.backends()["cpu"]
        if not ok:
            raise NotImplementedError(why)


class ColdCompile(_Cold):
    def timeraw_attention_float32(self):
        return 'attnnb.attention(q, q, q, backend="cpu")', _SETUP


class ColdCompileBackward(_Cold):
    """The backward kernels' cold compile: skipped where ``ATTNNB_ASV_SKIP_SLOW`` is set.

    Its setup compiles the forward too (untimed), so one sample costs about 45 s;
    CI's single quick pass sets the variable to stay within its time budget, while
    a recorded history (``asv run`` without it) measures it.
    """

    def setup(self):
        import os

        if os.environ.get("ATTNNB_ASV_SKIP_SLOW"):
            raise NotImplementedError("ATTNNB_ASV_SKIP_SLOW is set (CI's quick pass)")
        super().setup()

    def timeraw_attention_backward_float32(self):
        setup = _SETUP + ('_, pullback = attnnb.vjp(attnnb.attention, q, q, q, backend="cpu")\n'
                          'dout = np.ones_like(q)\n')
        return "pullback(dout)", setup

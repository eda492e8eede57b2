"""Cheap cases for tests/test_warmup.py, in the form of :mod:`attnnb.checks`.

Each compiles one small kernel (ToMe's unmerge gather, about a second), so
that the warmup engine can be tested without compiling the attention kernels.
Two cases share the float32 kernel: two workers must not both compile it.
"""

from __future__ import annotations

import numpy as np


def _unmerge(dtype):
    def run(backend):
        from attnnb.cpu.tome import unmerge

        x = np.arange(12, dtype=dtype).reshape(1, 4, 3)
        return unmerge(x, np.array([[0, 1, 1, 3, 2]]))

    return run


def _broken(backend):
    raise ValueError("broken on purpose")


def cases():
    return [("unmerge float32", _unmerge(np.float32)),
            ("unmerge float32 again", _unmerge(np.float32)),
            ("unmerge float64", _unmerge(np.float64)),
            ("broken", _broken)]

"""The progress bar of the commands that take a while (``bench``, ``warmup``).

tqdm where it is installed (the ``bench`` extra), else :class:`TextBar`, a
minimal bar with the same methods; both write to stderr, so that the
commands' tables and closing lines on stdout stay clean.
"""

from __future__ import annotations

import sys


class TextBar:
    """A minimal progress bar on stderr, for when tqdm is not installed."""

    def __init__(self, total, desc=""):
        self.total, self.n, self.desc = max(total, 1), 0, desc

    def update(self, k=1):
        self.n += k
        width = 30
        done = int(width * self.n / self.total)
        sys.stderr.write(f"\r{self.desc} [{'#' * done}{'.' * (width - done)}] "
                         f"{self.n}/{self.total}")
        sys.stderr.flush()

    def set_description(self, desc):
        self.desc = desc

    def close(self):
        sys.stderr.write("\n")
        sys.stderr.flush()


def progress(total, desc="bench"):
    """tqdm when importable, else :class:`TextBar`."""
    try:
        from tqdm import tqdm
    except ImportError:
        return TextBar(total, desc)
    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False)

"""Benchmark cases for ``python -m attnnb bench`` (engine: :mod:`attnnb.bench`).

Convention: every module here defines ``cases(quick: bool) -> list[dict]``.
Each dict is one row group of the table:

``name`` : str
    What is measured, e.g. ``"attention f32 B=1 H=8 N=1024 D=64"``.
``work`` : float or None
    Floating-point operations of one call (for GFLOP/s and the share of
    this machine's sgemm rate); None where it makes no sense.
``candidates`` : dict[str, Callable[[], object]]
    Label -> a function of no arguments that does one call.  Labels such
    as ``"attnnb-cpu"``, ``"numpy"``, ``"torch"`` (add torch only when it
    is importable).  The first candidate is the one the others are
    compared with.  Inputs are made once, outside the callables.

Optional keys:

``measure`` : ``"time"`` (default) or ``"value"``
    ``"time"``: the engine times the callables, interleaved, and reports
    medians.  ``"value"``: each callable measures something itself (for
    example in a fresh subprocess) and returns a number, reported as is.
``unit`` : str
    The unit of a ``"value"`` row (``"MiB"``, ``"s"``).
``repeats`` : int
    Overrides the engine's repeat count for this case (slow ``"value"``
    rows use 1).
``target`` : str
    A short note printed beside the row (e.g. ``"< 256 MiB"``).
``compare`` : bool
    Also print the ratio to the first candidate for a ``"value"`` row
    (values of one unit measured alike, such as two times).

A module may raise ``ImportError`` from ``cases`` when what it measures is
unavailable; the engine reports it and goes on.
"""

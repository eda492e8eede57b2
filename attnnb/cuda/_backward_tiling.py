"""Tile sizes and shared-memory layouts of the cuda backward kernels.

Each of the two backward kernels (the query-tile kernel ``"dq"``, the
key-tile kernel ``"dkdv"``, :mod:`attnnb.cuda._backward_kernels`) has its
own :class:`~attnnb.cuda._micro.Tiling` (:func:`backward_tiling`): production
tiles by the largest head size, shrunk to 48 KiB of shared memory by
:func:`~attnnb.cuda._micro.tiling_for`, with tables of their own for one
stream of a differential pair (``d < Dv <= 128``) and for two score streams.
Threads and micro-tiles are the forward's (``(ty, tx)``: rows ``ty * TM``,
keys ``tx * TN``).  In the key-tile kernel thread ``(ty, tx)`` owns keys
``tx * TN ... + TN`` (the same keys as its scores) and columns ``ty * TDK``
of ``dK`` / ``ty * TVK`` of ``dV``; in the query-tile kernel rows
``ty * TM`` and columns ``tx * TD`` of ``dQ`` (:func:`geometry`).

Invariants: :func:`dq_parts` and :func:`dkdv_parts` list the kernels'
shared arrays in the order the kernels slice them (:func:`part_offsets`),
each a multiple of 4 elements long; the key-tile kernel's sizes are those of
:func:`key_tile_layout`'s tiling, the one it is compiled with.  The float32
builds that do not meet the register-tiling gate are listed, with the
reason, in :data:`KNOWN_GATE_FAILURES` (names as the PTX catalogue gives
them).  Figures behind the tables: gpu/RESULTS.md, "Static gate (no GPU):
ptxas figures, sm_90".
"""

from __future__ import annotations

from .._core.codes import SIGMOID
from ._micro import Tiling, tiling_for


def round_up4(n: int) -> int:
    """``n`` rounded up to a multiple of 4 (shared arrays stay 16-byte aligned)."""
    return -(-n // 4) * 4


def geometry(tiling: Tiling) -> dict:
    """Derived sizes of the backward kernels for a tiling (see the module notes)."""
    nx, ny = tiling.bk // tiling.tn, tiling.bq // tiling.tm
    td, tdk, tvk = -(-tiling.d // nx), -(-tiling.d // ny), -(-tiling.dv // ny)
    return dict(NX=nx, NY=ny, DV4=round_up4(tiling.dv), TD=td, DQP=td * nx, TDK=tdk,
                DKP=tdk * ny, TVK=tvk, DVKP=tvk * ny)


def dq_parts(tiling: Tiling) -> tuple[int, ...]:
    """Shared lengths of the query-tile kernel: ``Qt, dOt, KV, Vt, dSt, red, rows, flag``."""
    sizes = geometry(tiling)
    streams = tiling.streams
    kv = round_up4(max(tiling.dp * tiling.bk, tiling.bk * sizes["DQP"]))
    return (streams * tiling.dp * tiling.bq, sizes["DV4"] * tiling.bq, streams * kv,
            sizes["DV4"] * tiling.bk, streams * round_up4(tiling.bk * tiling.bq),
            round_up4(tiling.bq * sizes["NX"]), round_up4(tiling.bq), 4)


def key_tile_layout(tiling: Tiling) -> Tiling:
    """The tiling the key-tile kernel is laid out with: one stream's ``d < Dv <= 128`` as
    ``d = Dv`` (the score depth and the ``dK`` columns padded with zeros).

    At ``d = 64, Dv = 128`` the padding's flops buy the register tiling that no
    unpadded tiling reaches (gpu/RESULTS.md, "Static gate (no GPU): ptxas figures,
    sm_90"); a small ``d`` pays more (``d = 16, Dv = 128``: 8x the kernel's score work).
    """
    if tiling.streams == 1 and tiling.d < tiling.dv <= 128:
        return tiling._replace(d=tiling.dv)
    return tiling


def dkdv_parts(tiling: Tiling) -> tuple[int, ...]:
    """Shared lengths of the key-tile kernel: ``Kt, Vt, QQ, OO, Wt, dS, X``."""
    tiling = key_tile_layout(tiling)
    sizes = geometry(tiling)
    streams = tiling.streams
    qq = round_up4(max(tiling.dp * tiling.bq, tiling.bq * sizes["DKP"]))
    oo = round_up4(max(sizes["DV4"] * tiling.bq, tiling.bq * sizes["DVKP"]))
    tile = round_up4(tiling.bq * tiling.bk)
    return (streams * tiling.dp * tiling.bk, sizes["DV4"] * tiling.bk, streams * qq, oo, tile,
            streams * tile, tile)


def part_offsets(parts):
    """``(offsets, total)``: where each of ``parts`` (lengths) starts in one shared array."""
    out, at = [], 0
    for n in parts:
        out.append(at)
        at += n
    return out, at


# production tiles by the largest head size (float32 on sm_90), shrunk to fit 48 KiB by
# tiling_for: the query-tile kernel keeps TM x TD of dQ per thread, the key-tile kernel TN
# keys of dK and dV (at D <= 64 a taller query tile, one key a thread: no spill; at
# D <= 128 16-row query tiles and two keys a thread, whose small Q and dO tiles leave
# room for more keys: more FMA per shared load and fewer registers, gpu/RESULTS.md)
_PRODUCTION = {
    "dq": ((64, (32, 64, 2, 4)), (128, (32, 32, 2, 1))),
    "dkdv": ((64, (64, 32, 4, 1)), (128, (16, 32, 1, 2))),
}
# one stream with d < Dv <= 128 (the differential pair's streams: d = 64, Dv = 128): the
# query-tile kernel's 32 x 16 of 2 x 2 stays within the register gate there, the D <= 128
# tiles do not (gpu/RESULTS.md)
_PRODUCTION_NARROW_D = dict(_PRODUCTION, dq=((64, (32, 64, 2, 4)), (128, (32, 16, 2, 2))))
# two score streams (rectified differential attention): no tiling of the key-tile kernel meets the
# gate at d = 64, Dv = 128 (gpu/RESULTS.md), so it keeps 32 x 8 of 2 x 1
_PRODUCTION_TWO_STREAMS = dict(_PRODUCTION, dkdv=((64, (64, 32, 4, 1)), (128, (32, 32, 2, 1))))
# the key-tile kernel of sigmoid's and softpick's own builds: at D <= 64 their code takes
# 64 x 8 of 4 x 1 to 148-154 registers (float32, sm_90), 8 x 32 of 1 x 2 keeps to 128 at
# 4.2-5.3 FMA per shared load; at D <= 128 the production tiles keep to 128
_OWN_DKDV = ((64, (8, 32, 1, 2)), (128, (16, 32, 1, 2)))
# top-k's key-tile kernel of sigmoid's build: reading the selection's bits takes 8 x 32
# of 1 x 2 to 137 registers at D <= 64, 16 x 32 of 1 x 2 keeps to 128 (4.8 FMA per
# shared load)
_TOPK_SIGMOID_DKDV = ((64, (16, 32, 1, 2)), (128, (16, 32, 1, 2)))
# float32 kernels that do not meet the register-tiling gate yet, and why (the gate reports
# them as known failures; gpu/RESULTS.md has their figures)
KNOWN_GATE_FAILURES = {
    "backward two-stream dq float32 d=64": "more than 128 registers and fewer than 4 FMA per "
                                           "shared load: two score streams (not the default "
                                           "route of any mode)",
    "backward two-stream dkdv float32 d=64": "more than 128 registers and fewer than 4 FMA "
                                             "per shared load: two score streams, Dv = 128 "
                                             "(not the default route of any mode)",
    # at most 128 where they were built on 2026-12-07 (gpu/RESULTS.md), more here: the
    # same numba-cuda and nvJitLink on another host type
    "backward rectified dq float32 d=64": "130 registers on some build hosts (128 on others)",
    "backward topk dq-sigmoid float32 D=64": "139 registers on some build hosts (128 on "
                                             "others)",
    "backward topk dkdv-relu_expm1 float32 D=64": "135 registers on some build hosts (128 "
                                                  "on others)",
}

_PARTS = {"dq": dq_parts, "dkdv": dkdv_parts}


def backward_tiling(dtype, d: int, dv: int, streams: int = 1, kernel: str = "dq",
                    own=None, selected: bool = False) -> Tiling:
    """The tiling of one backward kernel (``"dq"`` or ``"dkdv"``) for a compute dtype and
    head sizes; ``own``: ``sigmoid``'s or ``softpick``'s builds
    (:func:`attnnb.cuda._micro.own_build`), whose key-tile kernel has tiles of its own
    (``selected``: top-k's, sigmoid's different again)."""
    parts = _PARTS[kernel]
    production = (_PRODUCTION_TWO_STREAMS if streams == 2 else
                  _PRODUCTION_NARROW_D if d < dv <= 128 else _PRODUCTION)[kernel]
    if own is not None and kernel == "dkdv":
        production = (_TOPK_SIGMOID_DKDV if selected and own == SIGMOID else _OWN_DKDV)
    return tiling_for(dtype, d, dv, streams, elements=lambda candidate: sum(parts(candidate)),
                      production=production)

"""The host side of mask and score functions on the cpu backend (:mod:`attnnb.mods`).

:func:`mod_kernel` gives the copy of a kernel with a problem's mods compiled
in (:func:`attnnb._core.specialise.specialise`), :func:`mods_argument` the ``mods``
argument every kernel takes (:mod:`attnnb.cpu._mod_hooks`), and
:func:`tile_map` the tile map of the problem's mask array and mask function
together (:mod:`attnnb.cpu._mask_tiles`).

A mask function's map has one entry per batch element only when the
function reads ``b``, and per head only when it reads ``h`` (seen in its
bytecode, and its helpers' and operands'): a document mask is classified once
for all heads.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading

import numpy as np

from .._core.specialise import specialise
from .._mods.compile import (
    arity,
    bind,
    compile_mask,
    compile_score,
    fingerprint,
    grad_views,
    param_grads,
    reads_argument,
)
from . import _mod_hooks
from ._jit import launch
from ._mask_tiles import (
    classify_kernel,
    combined_classes,
    mask_tile_classes,
    no_tile_map,
)
from ._mod_hooks import MOD_GRAD_GROUPS, no_mods
from ._tiles import TILE_K, TILE_Q


def has_mods(problem) -> bool:
    return problem.mask_mod is not None or problem.score_mod is not None


def _tag(problem) -> str:
    parts = []
    if problem.score_mod is not None:
        parts.append("s" + fingerprint(problem.score_mod))
    if problem.mask_mod is not None:
        parts.append("m" + fingerprint(problem.mask_mod))
    return "mod_" + "_".join(parts)


def _bindings(problem) -> dict:
    bound = {}
    offset = 1  # after the origin (mods_argument)
    if problem.score_mod is not None:
        score = compile_score(problem.score_mod, offset)
        bound.update(SCORE_FN=True, mod_value=score.value, mod_slope=score.slope,
                     mod_agrad=score.agrad)
        offset += arity(problem.score_mod)
        n_arrays = offset + (0 if problem.mask_mod is None else arity(problem.mask_mod))
        bound["mod_grad_views"] = grad_views(n_arrays)
    if problem.mask_mod is not None:
        bound.update(MASK_FN=True, mod_allowed=compile_mask(problem.mask_mod, offset).allowed)
    return bound


def mod_kernel(kernel_fn, problem):
    """``kernel_fn`` itself without mods, else its copy with the problem's mods bound to
    the hooks of :mod:`attnnb.cpu._mod_hooks` (a kernel that reaches neither the score
    function's nor the mask function's hook is an error, never a kernel without them)."""
    if not has_mods(problem):
        return kernel_fn
    required = ["mod_value"] if problem.score_mod is not None else []
    required += ["mod_allowed"] if problem.mask_mod is not None else []
    return specialise(kernel_fn, _bindings(problem), _tag(problem), required=required,
                      originals=vars(_mod_hooks))


def mods_argument(problem) -> tuple:
    """``(origin, *score_arrays, *mask_arrays)`` (:mod:`attnnb.cpu._mod_hooks`)."""
    if not has_mods(problem):
        return no_mods()
    Lq, Lk = problem.q.shape[2], problem.k.shape[2]
    origin = np.asarray(problem.dropout_origin, np.int64)
    score = () if problem.score_mod is None else bind(problem.score_mod, Lq, Lk)
    mask = () if problem.mask_mod is None else bind(problem.mask_mod, Lq, Lk)
    return (origin,) + score + mask


def group_gradients(problem, mods: tuple, n_tasks: int) -> tuple:
    """Zeroed gradient buffers of the score function's arrays, one set per group of the
    backward's ``n_tasks`` tasks (:func:`attnnb.cpu._mod_hooks.task_groups`), float64
    ``(n_groups, *shape)`` for each array of ``mods``; ``mods`` itself (never read)
    without a score function."""
    if problem.score_mod is None:
        return mods
    n_groups = min(n_tasks, MOD_GRAD_GROUPS)
    return tuple(np.zeros((n_groups,) + a.shape, np.float64) for a in mods)


def parameter_gradients(problem, mod_grads: tuple) -> tuple:
    """The score function's parameters' gradients from the groups' buffers (summed in
    group order: :func:`attnnb._mods.compile.param_grads`)."""
    n = arity(problem.score_mod)
    return param_grads(problem.score_mod, tuple(g.sum(axis=0) for g in mod_grads[1:1 + n]))


# The last few mask functions' tile maps, by everything they depend on: the layers of a
# model and a backward after its forward share one (the key hashes the arrays' bytes).
_MAPS: collections.OrderedDict = collections.OrderedDict()
_MAPS_KEPT = 8
_maps_lock = threading.Lock()


def _map_key(problem, shape) -> tuple:
    digest = hashlib.sha256()
    for a in mods_argument(problem):
        digest.update(f"{a.dtype}{a.shape}".encode())
        digest.update(np.ascontiguousarray(a).view(np.uint8).data)
    return (fingerprint(problem.mask_mod), shape, problem.q.shape[2], problem.k.shape[2],
            digest.hexdigest())


def function_tile_map(problem) -> np.ndarray:
    """The tile map of the problem's mask function, kept for the next calls (shared: never
    written; writeable all the same, so that the kernels see one array type)."""
    B, Hq, _, Lq, Lk, _, _ = problem.shape
    mod = problem.mask_mod
    problem = dataclasses.replace(problem, score_mod=None)  # one map per mask function
    shape = (B if reads_argument(mod, 0) else 1, Hq if reads_argument(mod, 1) else 1,
             -(-Lq // TILE_Q), -(-Lk // TILE_K))
    key = _map_key(problem, shape)
    with _maps_lock:
        found = _MAPS.get(key)
        if found is not None:
            _MAPS.move_to_end(key)
            return found
    classes = np.empty(shape, np.int8)
    if classes.size:
        launch(mod_kernel(classify_kernel, problem), np.zeros((1, 1, 1, 1), np.bool_), Lq, Lk,
               mods_argument(problem), classes)
    with _maps_lock:
        _MAPS[key] = classes
        while len(_MAPS) > _MAPS_KEPT:
            _MAPS.popitem(last=False)
    return classes


def tile_map(problem) -> np.ndarray:
    """The problem's tile map: its mask array's, its mask function's, both combined, or
    a placeholder (never read) with neither."""
    classes = None if problem.mask is None else mask_tile_classes(problem.mask)
    if problem.mask_mod is None:
        return no_tile_map() if classes is None else classes
    by_function = function_tile_map(problem)
    return by_function if classes is None else combined_classes(classes, by_function)

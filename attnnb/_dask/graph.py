"""The task graph of one Dask attention call: parts, tree merges, output arrays.

Every query block (batch block x head block x query block) gets one task
per key block it sees (a *part*), a tree of merge tasks over its parts,
``split_every`` at a time (Dask's own ``split_every`` setting, default 4,
as its tree reductions), and one *finish* task; the output arrays pick
their blocks from the finish tasks.  Task names read
``attnnb-<function>-<stage>-<token>``, so a graph can be inspected by stage.
"""

from __future__ import annotations

import operator
from numbers import Integral

import dask
from dask.array.core import Array
from dask.array.utils import meta_from_array
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph

DEFAULT_SPLIT_EVERY = 4


def split_every() -> int:
    """Parts merged per task: Dask's ``split_every`` setting (an int >= 2), default 4."""
    value = dask.config.get("split_every", None)
    if value is None:
        return DEFAULT_SPLIT_EVERY
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 2:
        raise ValueError("dask.config 'split_every' must be an integer >= 2 for attnnb's "
                         f"merges; got {value!r}")
    return int(value)


class Graph:
    """The tasks of one call, named ``attnnb-<op>-<stage>-<token>``."""

    def __init__(self, op: str, inputs, *params):
        self.op = op
        self.inputs = [x for x in inputs if x is not None]
        self.split_every = split_every()
        self.token = tokenize(op, *(x.name for x in self.inputs), self.split_every, *params)
        self.tasks = {}

    def name(self, stage: str) -> str:
        return f"attnnb-{self.op}-{stage}-{self.token}"

    def add(self, stage: str, index: tuple, task) -> tuple:
        key = (self.name(stage), *index)
        self.tasks[key] = task
        return key

    def reduce(self, stage: str, index: tuple, keys: list, merge) -> tuple:
        """Merge ``keys`` (in order) in a tree, ``split_every`` at a time; the root's key."""
        level = 0
        while len(keys) > 1:
            step = self.split_every
            keys = [self.add(f"{stage}{level}", index + (n,), (merge, keys[i:i + step]))
                    for n, i in enumerate(range(0, len(keys), step))]
            level += 1
        return keys[0]

    def array(self, stage: str, blocks: dict, chunks, dtype, like) -> Array:
        """An output array whose block ``index`` is item ``pick`` of the value of ``key``,
        for ``blocks[index] = (key, pick)`` (``pick`` None: the value itself).

        ``like`` gives the chunk type (NumPy or CuPy) of the result's meta.
        """
        main = self.name("tasks")
        name = self.name(stage)
        blocks = {(name, *index): key if pick is None else (operator.getitem, key, pick)
                  for index, (key, pick) in blocks.items()}
        graph = HighLevelGraph.from_collections(main, self.tasks, dependencies=self.inputs)
        layers = dict(graph.layers)
        layers[name] = blocks
        deps = dict(graph.dependencies)
        deps[name] = {main}
        meta = meta_from_array(like, ndim=len(chunks), dtype=dtype)
        return Array(HighLevelGraph(layers, deps), name, chunks, meta=meta)
